"""Make `import torchvision` work in the SGLang test venv (run once by `make sglang-venv`).

SGLang imports torchvision. The torchvision 0.28.0 wheel is a CUDA build: its `_C`
extension needs libtorch_cuda, so on a CPU-only torch its ops are absent and
`torchvision.extension._has_ops()` is false. Every fake-op registration in
`_meta_registrations.py` checks that, except the two for `torchvision::nms` and
`torchvision::qnms`, which then fail with "operator does not exist" and break the
import. This rewrites those two decorators to register only when the ops exist.
Idempotent; test scaffolding only (kvgate itself never touches torchvision).
"""

from __future__ import annotations

import importlib.util
import pathlib
import sys

GUARD = "(lambda f: f)"


def main() -> int:
    spec = importlib.util.find_spec("torchvision")
    if spec is None or not spec.submodule_search_locations:
        print("torchvision is not installed in this interpreter", file=sys.stderr)
        return 1
    path = pathlib.Path(list(spec.submodule_search_locations)[0]) / "_meta_registrations.py"
    text = path.read_text()
    patched = text
    for op in ("nms", "qnms"):
        plain = f'@torch.library.register_fake("torchvision::{op}")\n'
        guarded = (
            f'@(torch.library.register_fake("torchvision::{op}") '
            f"if torchvision.extension._has_ops() else {GUARD})\n"
        )
        patched = patched.replace(plain, guarded)
    if patched != text:
        path.write_text(patched)
        print(f"guarded torchvision nms/qnms fake registrations in {path}")
    elif GUARD not in text:
        print(f"{path}: the nms/qnms registrations were not found; torchvision changed?", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
