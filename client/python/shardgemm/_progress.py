"""Progress of a put or get: a tqdm bar when asked for and tqdm is
installed (pip install 'shardgemm[progress]'), or the caller's callback."""
from __future__ import annotations

import warnings
from typing import Callable, Optional, Union

#: progress=: False (none), True (a tqdm bar), or a callable(done_bytes, total_bytes).
Progress = Union[bool, None, Callable[[int, int], None]]

_warned = False


class Meter:
    def __init__(self, progress: Progress, total: int, desc: str) -> None:
        self.total, self.done = total, 0
        self._callback: Optional[Callable[[int, int], None]] = None
        self._bar = None
        if callable(progress):
            self._callback = progress
        elif progress:
            try:
                from tqdm.auto import tqdm
            except ImportError:
                global _warned
                if not _warned:
                    _warned = True
                    warnings.warn("progress=True needs tqdm (pip install 'shardgemm[progress]'); "
                                  "going on without a progress bar", RuntimeWarning, stacklevel=4)
            else:
                self._bar = tqdm(total=total, desc=desc, unit="B", unit_scale=True, unit_divisor=1024,
                                 leave=False)

    def update(self, n: int) -> None:
        self.done += n
        if self._bar is not None:
            self._bar.update(n)
        if self._callback is not None:
            self._callback(self.done, self.total)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None

    def __enter__(self) -> "Meter":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
