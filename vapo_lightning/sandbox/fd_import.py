"""Imports through directory file descriptors: `DirFdFinder` finds stdlib modules below
folders the server opened before a sandbox dropped its uid, for a sandbox that cannot reach
them by path (an interpreter under a mode-700 home such as /root, without a root server's
minimal root to mount it in: `rootfs`). Installed last on `sys.meta_path` by
`isolation.Isolation`; stdlib only, as everything the server imports.
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import os


class _FdLoader:
    """Loads a source module read through a directory fd; no bytecode cache.

    A plain loader (the protocol `importlib` calls), not an `importlib.abc` subclass: importing
    `importlib.abc` pulls in `tempfile` and `random`, whose after-fork hooks would then run in
    every sandbox the server forks (see server.PRELOAD)."""

    def __init__(self, dir_fd: int, rel: str, path: str) -> None:
        self.dir_fd, self.rel, self.path = dir_fd, rel, path

    def create_module(self, spec):  # the default module object
        return None

    def exec_module(self, module) -> None:
        code = compile(self.get_data(self.path), self.path, "exec", dont_inherit=True)
        exec(code, module.__dict__)

    def get_filename(self, fullname: str) -> str:
        return self.path

    def get_data(self, path: str) -> bytes:
        fd = os.open(self.rel, os.O_RDONLY, dir_fd=self.dir_fd)
        with os.fdopen(fd, "rb") as f:
            return f.read()

    def get_source(self, fullname: str) -> str:  # for tracebacks and `inspect`
        return self.get_data(self.path).decode("utf-8")


class DirFdFinder:
    """Finds stdlib modules below directories we hold open, when paths are not searchable.

    `roots` maps a directory path to an fd opened before the privilege drop. Source modules are
    read with openat(); extension modules are loaded through /proc/self/fd/<n>.
    """

    def __init__(self, roots: dict[str, int]) -> None:
        self.roots = roots

    def find_spec(self, fullname, path=None, target=None):
        name = fullname.rpartition(".")[2]
        if path is None:
            places = [(root, ".") for root in self.roots]
        else:
            places = []
            for base in path:
                roots = [r for r in self.roots if base == r or base.startswith(r + "/")]
                if roots:
                    root = max(roots, key=len)
                    places.append((root, os.path.relpath(base, root)))
        for root, rel_dir in places:
            spec = self._spec(fullname, name, root, rel_dir)
            if spec is not None:
                return spec
        return None

    def _spec(self, fullname, name, root, rel_dir):
        fd = self.roots[root]

        def exists(rel):
            try:
                os.stat(rel, dir_fd=fd)
                return True
            except OSError:
                return False

        pkg_init = os.path.normpath(f"{rel_dir}/{name}/__init__.py")
        if exists(pkg_init):
            loader = _FdLoader(fd, pkg_init, f"{root}/{pkg_init}")
            spec = importlib.util.spec_from_file_location(
                fullname,
                loader.path,
                loader=loader,
                submodule_search_locations=[os.path.normpath(f"{root}/{rel_dir}/{name}")],
            )
            return spec
        rel = os.path.normpath(f"{rel_dir}/{name}.py")
        if exists(rel):
            loader = _FdLoader(fd, rel, f"{root}/{rel}")
            return importlib.util.spec_from_file_location(fullname, loader.path, loader=loader)
        for suffix in importlib.machinery.EXTENSION_SUFFIXES:
            rel = os.path.normpath(f"{rel_dir}/{name}{suffix}")
            if exists(rel):
                ext_fd = os.open(rel, os.O_RDONLY, dir_fd=fd)
                loader = importlib.machinery.ExtensionFileLoader(fullname, f"/proc/self/fd/{ext_fd}")
                return importlib.util.spec_from_file_location(fullname, loader.path, loader=loader)
        return None
