"""Reading files as pipes: list them, open them, read their lines."""

from __future__ import annotations

import fnmatch
import os
from typing import Iterator, Sequence, Union

from shoal.core.data.datapipes.iter import IterDataPipe, _OneSource, functional


@functional("list_files")
class FileLister(IterDataPipe):
    """Paths under `root` (a directory, a file, or a pipe of them) whose names match `masks`,
    each directory's files sorted, as torch's FileLister lists them."""

    def __init__(self, root: Union[str, Sequence[str], IterDataPipe] = ".",
                 masks: Union[str, list[str]] = "", *, recursive: bool = False,
                 abspath: bool = False, non_deterministic: bool = False,
                 length: int = -1) -> None:
        self.root = [root] if isinstance(root, str) else root
        self.masks = masks
        self.recursive, self.abspath = recursive, abspath
        self.non_deterministic, self.length = non_deterministic, length

    def sources(self) -> list[IterDataPipe]:
        return [self.root] if isinstance(self.root, IterDataPipe) else []

    def _match(self, name: str) -> bool:
        masks = self.masks
        if not masks:
            return True
        masks = [masks] if isinstance(masks, str) else masks
        return any(fnmatch.fnmatch(name, m) for m in masks)

    def __iter__(self) -> Iterator[str]:
        for root in self.root:
            yield from self._under(root)

    def _under(self, root: str) -> Iterator[str]:
        if os.path.isfile(root):
            path = os.path.abspath(root) if self.abspath else root
            if self._match(os.path.basename(path)):
                yield path
            return
        if not os.path.isdir(root):
            raise FileNotFoundError(f"FileLister: {root!r} is neither a file nor a directory")
        for dirpath, dirnames, filenames in os.walk(root):
            if self.abspath:
                dirpath = os.path.abspath(dirpath)
            if not self.non_deterministic:
                filenames.sort()
                dirnames.sort()  # in place: os.walk descends in this order
            for name in filenames:
                if self._match(name):
                    yield os.path.join(dirpath, name)
            if not self.recursive:
                break

    def __len__(self) -> int:
        if self.length == -1:
            raise TypeError(f"{type(self).__name__} instance doesn't have valid length")
        return self.length


@functional("open_files")
class FileOpener(_OneSource):
    """(path, open file) for each path; the consumer reads it before asking for the next."""

    def __init__(self, source: IterDataPipe, mode: str = "r", encoding: str | None = None) -> None:
        if mode not in ("r", "b", "rb", "rt"):
            raise ValueError(f"FileOpener opens files for reading: mode {mode!r} is not one of "
                             "'r', 'b', 'rb', 'rt'")
        super().__init__(source)
        self.mode = "rb" if "b" in mode else "r"
        self.encoding = encoding

    def __iter__(self) -> Iterator:
        for path in self.source:
            with open(path, self.mode, encoding=self.encoding) as stream:
                yield path, stream


@functional("readlines")
class LineReader(_OneSource):
    """(path, line) for each line of each (path, stream)."""

    def __init__(self, source: IterDataPipe, *, strip_newline: bool = True) -> None:
        super().__init__(source)
        self.strip_newline = strip_newline

    def __iter__(self) -> Iterator:
        for path, stream in self.source:
            for line in stream:
                if self.strip_newline:
                    line = line.rstrip("\r\n") if isinstance(line, str) else line.rstrip(b"\r\n")
                yield path, line
