/*
 * kiln_torch — libkiln_torch, kiln's TorchScript extension.
 *
 * Loading the library (torch.ops.load_library from Python, or linking it
 * into a C++ program with libtorch) registers, under the namespace `kiln`:
 *
 *   class torch.classes.kiln.Model
 *     Model (str path, str keyring, int core)   no I/O: loads on first use
 *     run (Tensor[] inputs) -> Tensor[]
 *     digest () -> str                          the artifact's content hash
 *     core () -> int                            the execution core it runs on
 *     __getstate__ () -> Tensor                 the artifact file's bytes
 *     __setstate__ (Tensor)                     verified and loaded at once
 *   kiln::run (Model model, Tensor[] inputs) -> Tensor[]
 *   kiln::set_keyring (str dir) -> ()
 *   kiln::keyring () -> str
 *
 * A Model is a signed artifact (.kar) loaded with libkilnrt on the
 * process's shared runtime (kiln_rt_shared), so that it takes its turn in
 * the same round-robin placement as models loaded through ctypes.  Saving
 * a TorchScript module that holds one embeds the artifact's bytes, as a
 * 1-D uint8 tensor: a record of its own in the .pt archive rather than a
 * string in data.pkl, and picklable from Python too (torch.save, deepcopy),
 * where a str would have to be UTF-8.  Loading it (torch.jit.load) writes
 * them to a private temporary file (0600 in $TMPDIR, unlinked as soon as
 * they are loaded) and verifies them against the process keyring before
 * anything else happens, so that a tampered file fails to load with
 * kiln's message.
 *
 * The process keyring is the directory given to kiln::set_keyring, else
 * what kiln.compile.default_keyring() picks: $KILN_KEYRING, else
 * CONFIG/keyring when that directory exists, else CONFIG/keys (the user's
 * own key), where CONFIG is $KILN_CONFIG_DIR, $XDG_CONFIG_HOME/kiln or
 * $HOME/.config/kiln.
 *
 * Every error is a c10::Error (RuntimeError in Python) whose message
 * starts with "kiln: " and carries libkilnrt's, which names the tensor,
 * the expected and the received shape, or the file at fault.
 */
#ifndef KILN_TORCH_H
#define KILN_TORCH_H

#include <string>

namespace kiln_torch {

/* Set the process keyring (what kiln::set_keyring does); "" goes back to
 * the default above. */
void set_keyring (const std::string &dir);

/* The process keyring, resolved now; throws c10::Error when there is no
 * config directory to take it from. */
std::string keyring ();

}  // namespace kiln_torch

#endif
