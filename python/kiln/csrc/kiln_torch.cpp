/*
 * kiln_torch — torch.classes.kiln.Model and the kiln:: ops: a signed kiln
 * artifact as a TorchScript custom class (python/kiln/csrc/kiln_torch.h
 * has the interface and the keyring rules).
 *
 * Invariants of a Model: `model_` is NULL until the first call that needs
 * it loads the artifact at `path_` (under `lock_`), and never changes
 * after; `inputs_` and `outputs_` describe it once it is set.  A Model
 * made by __setstate__ is loaded at once, from a private temporary file
 * that is unlinked right after; it keeps that file open (`fd_`) so that
 * it can be saved again, and `path_` names nothing any more.
 */
#include "python/kiln/csrc/kiln_torch.h"

#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include <ATen/ATen.h>
#include <torch/custom_class.h>
#include <torch/library.h>

extern "C" {
#include "common/kiln_limits.h"
#include "runtime/kiln_rt.h"
}

namespace {

/* --- the process keyring ------------------------------------------------ */

std::mutex s_keyring_lock;
std::string s_keyring;               /* set by kiln::set_keyring; "" unset */

std::string
s_env (const char *name)
{
    const char *v = getenv (name);
    return v ? std::string (v) : std::string ();
}

bool
s_is_dir (const std::string &path)
{
    struct stat st;
    return stat (path.c_str (), &st) == 0 && S_ISDIR (st.st_mode);
}

/* kiln.compile.config_dir(), as the C libraries compute it. */
std::string
s_config_dir ()
{
    std::string dir = s_env ("KILN_CONFIG_DIR");
    if (!dir.empty ())
        return dir;
    dir = s_env ("XDG_CONFIG_HOME");
    if (!dir.empty ())
        return dir + "/kiln";
    dir = s_env ("HOME");
    if (!dir.empty ())
        return dir + "/.config/kiln";
    TORCH_CHECK (false, "kiln: no config directory to find a keyring in: set "
                 "KILN_KEYRING, KILN_CONFIG_DIR or HOME, or call "
                 "torch.ops.kiln.set_keyring");
}

/* --- files ---------------------------------------------------------------- */

/* The bytes of the open artifact `fd` (named `what` in errors), from its
 * start, bounded by KILN_MAX_ARTIFACT_BYTES, as a 1-D uint8 tensor. */
at::Tensor
s_read_fd (int fd, const std::string &what)
{
    struct stat st;
    TORCH_CHECK (fstat (fd, &st) == 0 && S_ISREG (st.st_mode), "kiln: ", what,
                 " is not a regular file");
    TORCH_CHECK ((unsigned long long) st.st_size <= KILN_MAX_ARTIFACT_BYTES,
                 "kiln: ", what, " is ", st.st_size, " bytes, more than "
                 "KILN_MAX_ARTIFACT_BYTES (", KILN_MAX_ARTIFACT_BYTES, ")");
    at::Tensor bytes = at::empty ({ (int64_t) st.st_size },
                                 at::TensorOptions ().dtype (at::kByte));
    uint8_t *data = bytes.data_ptr<uint8_t> ();
    size_t size = (size_t) st.st_size, got = 0;
    while (got < size) {
        ssize_t n = pread (fd, data + got, size - got, (off_t) got);
        if (n < 0 && errno == EINTR)
            continue;
        TORCH_CHECK (n > 0, "kiln: could not read ", what, ": ",
                     n < 0 ? strerror (errno) : "it shrank while being read");
        got += (size_t) n;
    }
    return bytes;
}

/* The bytes of the artifact file at `path`, as s_read_fd. */
at::Tensor
s_read_file (const std::string &path)
{
    int fd = open (path.c_str (), O_RDONLY | O_CLOEXEC);
    TORCH_CHECK (fd >= 0, "kiln: could not open artifact '", path, "': ",
                 strerror (errno));
    try {
        at::Tensor bytes = s_read_fd (fd, "artifact '" + path + "'");
        close (fd);
        return bytes;
    } catch (...) {
        close (fd);
        throw;
    }
}

/* Write `size` bytes at `data` to a new private (0600) file in $TMPDIR;
 * returns its path, and in *fd_out the file, open for reading. */
std::string
s_write_temp (const uint8_t *data, size_t size, int *fd_out)
{
    std::string dir = s_env ("TMPDIR");
    if (dir.empty ())
        dir = "/tmp";
    std::string tmpl = dir + "/kiln-embedded-XXXXXX";
    std::vector<char> name (tmpl.begin (), tmpl.end ());
    name.push_back ('\0');
    int fd = mkostemp (name.data (), O_CLOEXEC);
    TORCH_CHECK (fd >= 0, "kiln: could not create a temporary file in '", dir,
                 "' for the embedded artifact: ", strerror (errno));
    std::string path (name.data ());
    size_t put = 0;
    while (put < size) {
        ssize_t n = write (fd, data + put, size - put);
        if (n < 0 && errno == EINTR)
            continue;
        if (n < 0) {
            int e = errno;
            close (fd);
            unlink (path.c_str ());
            TORCH_CHECK (false, "kiln: could not write the embedded artifact to '",
                         path, "': ", strerror (e));
        }
        put += (size_t) n;
    }
    *fd_out = fd;
    return path;
}

/* --- dtypes -------------------------------------------------------------- */

/* kiln's dtype code (common/kiln_dtype.h) for a torch dtype; 0 (undefined)
 * when kiln has none, which kiln_model_run then reports by name. */
int
s_kiln_dtype (c10::ScalarType t)
{
    switch (t) {
    case c10::ScalarType::Float:  return KILN_DT_FLOAT32;
    case c10::ScalarType::Byte:   return KILN_DT_UINT8;
    case c10::ScalarType::Char:   return KILN_DT_INT8;
    case c10::ScalarType::Int:    return KILN_DT_INT32;
    case c10::ScalarType::Long:   return KILN_DT_INT64;
    case c10::ScalarType::Bool:   return KILN_DT_BOOL;
    case c10::ScalarType::Half:   return KILN_DT_FLOAT16;
    case c10::ScalarType::BFloat16: return KILN_DT_BFLOAT16;
    case c10::ScalarType::Double: return KILN_DT_FLOAT64;
    default:                      return KILN_DT_UNDEFINED;
    }
}

bool
s_torch_dtype (int kiln, c10::ScalarType *out)
{
    switch (kiln) {
    case KILN_DT_FLOAT32: *out = c10::ScalarType::Float;  return true;
    case KILN_DT_UINT8:   *out = c10::ScalarType::Byte;   return true;
    case KILN_DT_INT8:    *out = c10::ScalarType::Char;   return true;
    case KILN_DT_INT32:   *out = c10::ScalarType::Int;    return true;
    case KILN_DT_INT64:   *out = c10::ScalarType::Long;   return true;
    case KILN_DT_BOOL:    *out = c10::ScalarType::Bool;   return true;
    case KILN_DT_FLOAT16: *out = c10::ScalarType::Half;   return true;
    case KILN_DT_BFLOAT16: *out = c10::ScalarType::BFloat16; return true;
    case KILN_DT_FLOAT64: *out = c10::ScalarType::Double; return true;
    default:              return false;
    }
}

/* --- the custom class ---------------------------------------------------- */

struct Io {
    std::string name;                /* input or output name */
    c10::ScalarType dtype;
    std::vector<int64_t> shape;
};

class Model : public torch::CustomClassHolder {
public:
    /* Remembers where the artifact is; nothing is read before first use. */
    Model (std::string path, std::string keyring, int64_t core)
        : path_ (std::move (path)), keyring_ (std::move (keyring))
    {
        TORCH_CHECK (core >= -1 && core <= INT_MAX,
                     "kiln: no core ", core, " (-1 places the model round-robin)");
        core_ = (int) core;
    }

    Model (const Model &) = delete;
    Model &operator= (const Model &) = delete;

    ~Model () override
    {
        kiln_model_destroy (&model_);
        if (fd_ >= 0)
            close (fd_);
    }

    /* __setstate__: the embedded bytes, verified against the process
     * keyring and loaded now.  They go through a private temporary file,
     * unlinked as soon as they are loaded; the file stays open, so that
     * the model can be saved again, and nothing is left behind even when
     * the process is killed. */
    static c10::intrusive_ptr<Model>
    from_state (const at::Tensor &state)
    {
        TORCH_CHECK (state.defined () && state.scalar_type () == at::kByte
                     && state.dim () == 1 && state.device ().is_cpu (),
                     "kiln: the embedded artifact is not a 1-D uint8 CPU tensor");
        at::Tensor bytes = state.contiguous ();
        size_t size = (size_t) bytes.numel ();
        TORCH_CHECK (size > 0, "kiln: the embedded artifact is empty");
        TORCH_CHECK ((unsigned long long) size <= KILN_MAX_ARTIFACT_BYTES,
                     "kiln: the embedded artifact is ", size,
                     " bytes, more than KILN_MAX_ARTIFACT_BYTES (",
                     KILN_MAX_ARTIFACT_BYTES, ")");
        std::string keyring = kiln_torch::keyring ();
        int fd = -1;
        std::string path = s_write_temp (bytes.data_ptr<uint8_t> (), size, &fd);
        kiln_err_t err = {};
        kiln_model_t *m = nullptr;
        c10::intrusive_ptr<Model> self;
        try {
            self = c10::make_intrusive<Model> (path, keyring, -1);
            self->fd_ = fd;           /* from here on its destructor closes it */
            fd = -1;
            m = self->try_load (&err);
        } catch (...) {
            if (fd >= 0)
                close (fd);
            unlink (path.c_str ());
            throw;
        }
        unlink (path.c_str ());
        if (!m) {
            std::string msg = s_unpath (err.msg, path);
            bool refused = err.code == KILN_EVERIFY || err.code == KILN_EFORMAT
                           || err.code == KILN_ELIMIT;
            TORCH_CHECK (false, "kiln: embedded artifact ",
                         refused ? "failed verification against keyring '"
                                 : "could not be loaded with keyring '",
                         keyring, "': ", msg);
        }
        return self;
    }

    /* __getstate__: the artifact's bytes, as a 1-D uint8 tensor. */
    at::Tensor
    state () const
    {
        if (fd_ >= 0)
            return s_read_fd (fd_, "the embedded artifact");
        return s_read_file (path_);
    }

    std::vector<at::Tensor>
    run (const std::vector<at::Tensor> &inputs)
    {
        kiln_model_t *m = loaded ();
        if (inputs.size () != inputs_.size ()) {
            std::string names;
            for (const Io &io : inputs_)
                names += (names.empty () ? "'" : ", '") + io.name + "'";
            TORCH_CHECK (false, "kiln: the model takes ", inputs_.size (),
                         " input", inputs_.size () == 1 ? "" : "s", " (", names,
                         "), got ", inputs.size ());
        }
        std::vector<at::Tensor> held;           /* contiguous inputs, alive */
        std::vector<kiln_rt_tensor_t> in (inputs.size ());
        held.reserve (inputs.size ());
        for (size_t i = 0; i < inputs.size (); i++) {
            const at::Tensor &t = inputs[i];
            const std::string &name = inputs_[i].name;
            TORCH_CHECK (t.defined (), "kiln: input '", name, "' is undefined");
            TORCH_CHECK (t.device ().is_cpu (), "kiln: input '", name, "' is on ",
                         t.device (), "; kiln runs on CPU tensors");
            TORCH_CHECK (t.dim () <= KILN_MAX_RANK, "kiln: input '", name, "' has ",
                         t.dim (), " dimensions; kiln handles at most ",
                         KILN_MAX_RANK);
            held.push_back (t.contiguous ());
            const at::Tensor &c = held.back ();
            in[i].dtype = (kiln_dtype_t) s_kiln_dtype (c.scalar_type ());
            in[i].shape.rank = (int) c.dim ();
            for (int64_t d = 0; d < c.dim (); d++)
                in[i].shape.dims[d] = c.size (d);
            in[i].data = c.numel () > 0 ? c.data_ptr () : nullptr;
        }
        std::vector<at::Tensor> outs;
        std::vector<kiln_rt_tensor_t> out (outputs_.size ());
        outs.reserve (outputs_.size ());
        for (size_t i = 0; i < outputs_.size (); i++) {
            outs.push_back (at::empty (outputs_[i].shape,
                                       at::TensorOptions ().dtype (outputs_[i].dtype)));
            out[i].data = outs.back ().numel () > 0 ? outs.back ().data_ptr () : nullptr;
        }
        kiln_err_t err = {};
        int rc = kiln_model_run (m, in.data (), (int) in.size (), out.data (),
                                 (int) out.size (), &err);
        TORCH_CHECK (rc == 0, "kiln: ", err.msg);
        return outs;
    }

    std::string
    digest ()
    {
        char hex[KILN_HEX_LEN];
        kiln_err_t err = {};
        TORCH_CHECK (kiln_model_digest (loaded (), hex, &err) == 0, "kiln: ", err.msg);
        return std::string (hex);
    }

    int64_t
    core ()
    {
        return kiln_model_core (loaded ());
    }

private:
    /* The loaded model; loads it on first use, throwing kiln's error. */
    kiln_model_t *
    loaded ()
    {
        kiln_err_t err = {};
        kiln_model_t *m = try_load (&err);
        TORCH_CHECK (m, "kiln: ", err.msg);
        return m;
    }

    /* The loaded model, or NULL with `err` filled in (and the next call
     * tries again). */
    kiln_model_t *
    try_load (kiln_err_t *err)
    {
        std::lock_guard<std::mutex> guard (lock_);
        if (model_)
            return model_;
        kiln_rt_t *rt = kiln_rt_shared (err);
        if (!rt)
            return nullptr;
        kiln_model_t *m = kiln_rt_load_on (rt, path_.c_str (), keyring_.c_str (),
                                           core_, err);
        if (!m)
            return nullptr;
        std::vector<Io> ins, outs;
        if (s_describe (m, 0, &ins, err) || s_describe (m, 1, &outs, err)) {
            kiln_model_destroy (&m);
            return nullptr;
        }
        inputs_ = std::move (ins);
        outputs_ = std::move (outs);
        model_ = m;
        return m;
    }

    /* The model's inputs (outputs when `output`), from its manifest. */
    static int
    s_describe (kiln_model_t *m, int output, std::vector<Io> *ios, kiln_err_t *err)
    {
        int n = kiln_model_io_count (m, output);
        for (int i = 0; i < n; i++) {
            const char *name = nullptr;
            int dtype = 0;
            int64_t dims[KILN_MAX_RANK];
            int rank = kiln_model_io (m, output, i, &name, &dtype, dims, err);
            if (rank < 0)
                return rank;
            Io io;
            io.name = name;
            if (!s_torch_dtype (dtype, &io.dtype))
                return kiln_error (err, KILN_EUNSUPPORTED, "%s '%s' has kiln dtype %d, "
                                   "which torch cannot hold",
                                   output ? "output" : "input", name, dtype);
            io.shape.assign (dims, dims + rank);
            ios->push_back (std::move (io));
        }
        return 0;
    }

    /* `msg` without the temporary file's path, which means nothing to
     * whoever loads a saved module. */
    static std::string
    s_unpath (std::string msg, const std::string &path)
    {
        const std::string prefix = "artifact '" + path + "': ";
        for (size_t at; (at = msg.find (prefix)) != std::string::npos;)
            msg.erase (at, prefix.size ());
        for (size_t at; (at = msg.find (path)) != std::string::npos;)
            msg.replace (at, path.size (), "(embedded artifact)");
        return msg;
    }

    std::string path_;               /* the artifact file */
    std::string keyring_;            /* the directory it is verified against */
    int core_ = -1;                  /* the core asked for; -1 round-robin */
    int fd_ = -1;                    /* the embedded artifact's unlinked
                                        file (from __setstate__), or -1 */
    std::mutex lock_;                /* guards the first load */
    kiln_model_t *model_ = nullptr;  /* loaded on first use; owned */
    std::vector<Io> inputs_;         /* the model's inputs, manifest order */
    std::vector<Io> outputs_;        /* and outputs */
};

std::vector<at::Tensor>
s_run_op (const c10::intrusive_ptr<Model> &model, const std::vector<at::Tensor> &inputs)
{
    return model->run (inputs);
}

void
s_set_keyring_op (const std::string &dir)
{
    kiln_torch::set_keyring (dir);
}

std::string
s_keyring_op ()
{
    return kiln_torch::keyring ();
}

}  // namespace

namespace kiln_torch {

void
set_keyring (const std::string &dir)
{
    std::lock_guard<std::mutex> guard (s_keyring_lock);
    s_keyring = dir;
}

std::string
keyring ()
{
    {
        std::lock_guard<std::mutex> guard (s_keyring_lock);
        if (!s_keyring.empty ())
            return s_keyring;
    }
    std::string env = s_env ("KILN_KEYRING");
    if (!env.empty ())
        return env;
    std::string config = s_config_dir ();
    if (s_is_dir (config + "/keyring"))
        return config + "/keyring";
    return config + "/keys";
}

}  // namespace kiln_torch

TORCH_LIBRARY (kiln, m)
{
    /* The class first: the ops' schemas name it. */
    m.class_<Model> ("Model")
        .def (torch::init<std::string, std::string, int64_t> ())
        .def ("run", &Model::run)
        .def ("digest", &Model::digest)
        .def ("core", &Model::core)
        .def_pickle (
            [] (const c10::intrusive_ptr<Model> &self) -> at::Tensor {
                return self->state ();
            },
            [] (at::Tensor bytes) -> c10::intrusive_ptr<Model> {
                return Model::from_state (bytes);
            });
    m.def ("run(__torch__.torch.classes.kiln.Model model, Tensor[] inputs) -> Tensor[]",
           s_run_op);
    m.def ("set_keyring(str dir) -> ()", s_set_keyring_op);
    m.def ("keyring() -> str", s_keyring_op);
}
