"""Kernel tests run on the GPU when there is one, else in Triton's CPU interpreter.

``TRITON_INTERPRET`` is read when a ``@triton.jit`` function is decorated, so it
must be set before any ``pdserve.kernels`` module is imported; pytest loads this
conftest before collecting the test modules of this directory (no other test
package imports ``pdserve.kernels``). With CUDA present it is left alone, so the
same tests exercise the compiled kernels.
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def _fix_interpreter_index() -> None:
    """Triton 3.6's interpreter turns scalar tensors into ints with ``int(array)``,
    which NumPy >= 2.3 refuses for its 1-element, 1-d scalars (so ``range(start,
    end, step)`` over tensor bounds fails). Take the element explicitly instead."""
    from triton.runtime import interpreter

    orig = interpreter._patch_lang_tensor
    if getattr(orig, "_pdserve_fixed", False):
        return

    def patched(tensor: object, scope: interpreter._LangPatchScope) -> None:
        orig(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    patched._pdserve_fixed = True  # type: ignore[attr-defined]
    interpreter._patch_lang_tensor = patched


if os.environ.get("TRITON_INTERPRET") == "1":
    _fix_interpreter_index()


@pytest.fixture(scope="session")
def device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")
