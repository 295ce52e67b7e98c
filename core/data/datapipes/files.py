"""Reading files as pipes: list them, open them, read their lines."""

from __future__ import annotations

import fnmatch
import os
from typing import Iterator, Sequence, Union

from shoal.core.data.datapipes.iter import IterDataPipe, _OneSource, functional


@functional("list_files")
class FileLister(IterDataPipe):
    """Paths under `root` (a directory, a file, or a pipe of them) matching `masks`, sorted."""

    def __init__(self, root: Union[str, Sequence[str], IterDataPipe] = ".",
                 masks: Union[str, list[str]] = "", *, recursive: bool = False) -> None:
        self.root = [root] if isinstance(root, str) else root
        self.masks = [masks] if isinstance(masks, str) else list(masks)
        self.recursive = recursive

    def sources(self) -> list[IterDataPipe]:
        return [self.root] if isinstance(self.root, IterDataPipe) else []

    def _match(self, name: str) -> bool:
        return not any(self.masks) or any(fnmatch.fnmatch(name, m) for m in self.masks)

    def __iter__(self) -> Iterator[str]:
        for root in self.root:
            if os.path.isfile(root):
                if self._match(os.path.basename(root)):
                    yield root
                continue
            if not os.path.isdir(root):
                raise FileNotFoundError(f"FileLister: {root!r} is neither a file nor a directory")
            for dirpath, dirnames, filenames in os.walk(root):
                dirnames.sort()
                for name in sorted(filenames):
                    if self._match(name):
                        yield os.path.join(dirpath, name)
                if not self.recursive:
                    break


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
