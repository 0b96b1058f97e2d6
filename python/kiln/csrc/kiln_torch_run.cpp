/*
 * kiln-torch-run — run a TorchScript module saved from kiln (m.pt) with
 * libtorch alone, no Python: proof that a C++ program can load and run
 * what kiln.trace produces.
 *
 *   kiln-torch-run M.pt [--keyring DIR] --input SHAPE:FILE ... --output-dir DIR
 *
 * SHAPE is the dimensions joined by 'x' ("1x3x8x8"; "" for a scalar),
 * FILE raw little-endian float32 of exactly that many elements.  The
 * inputs go to forward() in order; its result (a tensor, or tuples, lists
 * and dicts of them, flattened in order, a dict's values in insertion
 * order) is written one tensor per file, DIR/out<i>.bin, as raw float32,
 * and one line per output is printed: "out<i> [d0, d1, ...]".
 *
 * The embedded artifacts are verified against --keyring, else the
 * extension's default (python/kiln/csrc/kiln_torch.h: $KILN_KEYRING, ...).
 * Exits 0 on success, 1 on any error (printed on stderr), 2 on bad usage.
 */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include <string>
#include <vector>

#include <torch/script.h>

#include "python/kiln/csrc/kiln_torch.h"

extern "C" {
#include "common/kiln_limits.h"
}

namespace {

const char *s_usage =
    "usage: kiln-torch-run M.pt [--keyring DIR] --input SHAPE:FILE ... "
    "--output-dir DIR\n"
    "  SHAPE  dimensions joined by 'x' (1x3x8x8); FILE raw float32\n";

struct Input {
    std::vector<int64_t> shape;
    std::string file;
};

/* "1x3x8x8:x.bin" into `in`; false (with a message) when malformed. */
bool
s_parse_input (const std::string &arg, Input *in, std::string *why)
{
    size_t colon = arg.find (':');
    if (colon == std::string::npos) {
        *why = "--input '" + arg + "' is not SHAPE:FILE";
        return false;
    }
    std::string shape = arg.substr (0, colon);
    in->file = arg.substr (colon + 1);
    if (in->file.empty ()) {
        *why = "--input '" + arg + "' names no file";
        return false;
    }
    size_t at = 0;
    while (at < shape.size ()) {
        size_t x = shape.find ('x', at);
        std::string dim = shape.substr (at, x == std::string::npos ? x : x - at);
        char *end = nullptr;
        errno = 0;
        long long v = dim.empty () ? -1 : strtoll (dim.c_str (), &end, 10);
        if (dim.empty () || errno || *end || v < 0 || v > KILN_MAX_DIM) {
            *why = "--input '" + arg + "': bad dimension '" + dim + "'";
            return false;
        }
        in->shape.push_back (v);
        if ((int) in->shape.size () > KILN_MAX_RANK) {
            *why = "--input '" + arg + "' has more than " +
                   std::to_string (KILN_MAX_RANK) + " dimensions";
            return false;
        }
        if (x == std::string::npos)
            break;
        at = x + 1;
        if (at == shape.size ()) {
            *why = "--input '" + arg + "': shape ends with 'x'";
            return false;
        }
    }
    return true;
}

/* The input tensor: exactly numel float32 values from the file. */
at::Tensor
s_read_input (const Input &in)
{
    int64_t numel = 1;
    for (int64_t d : in.shape) {
        TORCH_CHECK (d == 0 || numel <= KILN_MAX_TENSOR_ELEMS / d, "input '",
                     in.file, "': more than KILN_MAX_TENSOR_ELEMS elements");
        numel *= d;
    }
    FILE *f = fopen (in.file.c_str (), "rb");
    TORCH_CHECK (f, "could not open input '", in.file, "': ", strerror (errno));
    struct stat st;
    if (fstat (fileno (f), &st) != 0 || st.st_size != numel * 4) {
        long long size = fstat (fileno (f), &st) == 0 ? (long long) st.st_size : -1;
        fclose (f);
        TORCH_CHECK (false, "input '", in.file, "' is ", size, " bytes; shape ",
                     c10::IntArrayRef (in.shape), " of float32 needs ", numel * 4);
    }
    at::Tensor t = at::empty (in.shape, at::TensorOptions ().dtype (at::kFloat));
    size_t got = numel ? fread (t.data_ptr (), 4, (size_t) numel, f) : 0;
    fclose (f);
    TORCH_CHECK (got == (size_t) numel, "could not read input '", in.file, "'");
    return t;
}

/* Every tensor in `v`, in order: tuples, lists and dict values flattened. */
void
s_flatten (const c10::IValue &v, std::vector<at::Tensor> *out)
{
    if (v.isTensor ())
        out->push_back (v.toTensor ());
    else if (v.isTuple ())
        for (const c10::IValue &e : v.toTupleRef ().elements ())
            s_flatten (e, out);
    else if (v.isList ())
        for (const c10::IValue &e : v.toListRef ())
            s_flatten (e, out);
    else if (v.isGenericDict ())
        for (const auto &kv : v.toGenericDict ())
            s_flatten (kv.value (), out);
    else
        TORCH_CHECK (false, "forward() returned a ", v.tagKind (),
                     ", which holds no tensor");
}

void
s_write_output (const at::Tensor &t, const std::string &path)
{
    at::Tensor c = t.to (at::kFloat).contiguous ();
    FILE *f = fopen (path.c_str (), "wb");
    TORCH_CHECK (f, "could not create '", path, "': ", strerror (errno));
    size_t n = (size_t) c.numel ();
    bool ok = (n == 0 || fwrite (c.data_ptr (), 4, n, f) == n);
    ok = (fclose (f) == 0) && ok;
    TORCH_CHECK (ok, "could not write '", path, "': ", strerror (errno));
}

int
s_run (const std::string &model, const std::vector<Input> &inputs,
       const std::string &out_dir)
{
    torch::jit::Module m = torch::jit::load (model);
    m.eval ();
    std::vector<c10::IValue> args;
    for (const Input &in : inputs)
        args.push_back (s_read_input (in));
    c10::InferenceMode guard;
    c10::IValue result = m.forward (args);
    std::vector<at::Tensor> outs;
    s_flatten (result, &outs);
    if (mkdir (out_dir.c_str (), 0755) != 0 && errno != EEXIST)
        TORCH_CHECK (false, "could not create '", out_dir, "': ", strerror (errno));
    for (size_t i = 0; i < outs.size (); i++) {
        s_write_output (outs[i], out_dir + "/out" + std::to_string (i) + ".bin");
        printf ("out%zu %s\n", i, c10::str (outs[i].sizes ()).c_str ());
    }
    return 0;
}

}  // namespace

int
main (int argc, char **argv)
{
    std::string model, out_dir, keyring;
    std::vector<Input> inputs;
    for (int i = 1; i < argc; i++) {
        std::string a = argv[i];
        bool has_value = i + 1 < argc;
        if (a == "-h" || a == "--help") {
            fputs (s_usage, stdout);
            return 0;
        } else if (a == "--keyring" && has_value) {
            keyring = argv[++i];
        } else if (a == "--output-dir" && has_value) {
            out_dir = argv[++i];
        } else if (a == "--input" && has_value) {
            Input in;
            std::string why;
            if (!s_parse_input (argv[++i], &in, &why)) {
                fprintf (stderr, "kiln-torch-run: %s\n%s", why.c_str (), s_usage);
                return 2;
            }
            inputs.push_back (std::move (in));
        } else if (a.rfind ("-", 0) != 0 && model.empty ()) {
            model = a;
        } else {
            fprintf (stderr, "kiln-torch-run: unexpected argument '%s'\n%s",
                     a.c_str (), s_usage);
            return 2;
        }
    }
    if (model.empty () || out_dir.empty ()) {
        fputs (s_usage, stderr);
        return 2;
    }
    try {
        if (!keyring.empty ())
            kiln_torch::set_keyring (keyring);
        return s_run (model, inputs, out_dir);
    } catch (const c10::Error &e) {
        fprintf (stderr, "kiln-torch-run: %s\n", e.what_without_backtrace ());
    } catch (const std::exception &e) {
        fprintf (stderr, "kiln-torch-run: %s\n", e.what ());
    }
    return 1;
}
