"""Warnings about names that moved or were renamed, pointing at the line that used the old name.

A renamed name is reached through different frames — ``pc.<old>``, ``from numpyro_pc import <old>``,
``importlib.import_module(...)``, a package's module ``__getattr__`` forwarding to a submodule's — so no
fixed ``stacklevel`` names the user's line on every path; :func:`warn_renamed` counts the frames at the
time of the warning (what ``skip_file_prefixes`` does from Python 3.12).
"""

from __future__ import annotations

import importlib
import os
import sys
import types
import warnings

__all__ = ["warn_renamed"]

_SKIPPED_FILES = (os.path.dirname(__file__) + os.sep, os.path.dirname(importlib.__file__) + os.sep)


def _is_bootstrap(frame: types.FrameType) -> bool:  # warnings' own test (Lib/warnings.py, _is_internal_frame)
    return "importlib" in frame.f_code.co_filename and "_bootstrap" in frame.f_code.co_filename


def _stacklevel_past_package() -> int:
    """The ``stacklevel`` at which ``warnings.warn``, called by this function's caller, names the first line
    outside this package and :mod:`importlib`, counted the way ``warnings`` counts (frames of
    ``importlib._bootstrap`` do not count and are passed over)."""
    level, frame = 1, sys._getframe(2)
    while frame.f_code.co_filename.startswith(_SKIPPED_FILES):
        back = frame.f_back
        while back is not None and _is_bootstrap(back):
            back = back.f_back
        if back is None:
            break
        level, frame = level + 1, back
    return level


def warn_renamed(message: str) -> None:
    """Issue ``message`` as a ``FutureWarning`` attributed to the first line outside :mod:`numpyro_pc`."""
    warnings.warn(message, FutureWarning, stacklevel=_stacklevel_past_package() + 1)
