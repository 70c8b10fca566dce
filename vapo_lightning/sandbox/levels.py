"""Isolation levels: what `min_isolation` (`CodeReward`, `PythonTool`) requires of the sandbox.

A level is a set of requirements (no network, no writable file system outside the run, not
root, ...); each requirement is met by any one of the sandbox layers that give it
(`Result.layers` lists those that took effect on this machine). A component that runs
model-written code names its level and refuses to start with less, saying what is missing and
how to get it.
"""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["ISOLATION_LEVELS", "missing_isolation", "require_isolation"]

# Each requirement is met by any one of its layers.
_REQUIREMENTS = {
    "limits": ("rlimits",),
    "clean_env": ("clean_env",),
    "no_tty": ("session",),
    "not_root": ("uid_drop",),
    "filesystem": ("landlock_fs",),
    "network": ("netns",),
    "reaping": ("pidns", "subreaper"),
    "private_tmp": ("private_tmp",),
    "signals": ("pidns", "landlock_scope"),
    "memory_cgroup": ("memory_cgroup",),
    "pids_cgroup": ("pids_cgroup",),
    "cpu_cgroup": ("cpu_cgroup",),
}
ISOLATION_LEVELS = {
    "none": (),
    "basic": ("limits", "clean_env", "no_tty", "not_root", "reaping"),
    "strong": ("limits", "clean_env", "no_tty", "not_root", "reaping", "filesystem", "network"),
    "full": tuple(_REQUIREMENTS),
}
"""What each `min_isolation` value requires (see `_HOW_TO` for how to get each part)."""

_HOW_TO = {
    "not_root": "candidate code would run as root: the server could not setresuid to its "
    "sandbox uid (layers `uid_drop`, `own_uid`)",
    "filesystem": "Landlock (Linux >= 5.13 with 'landlock' in /sys/kernel/security/lsm; add "
    "lsm=landlock,... to the kernel command line)",
    "network": "a network namespace: as root it needs CAP_SYS_ADMIN (in Docker "
    "`--cap-add SYS_ADMIN --security-opt seccomp=unconfined`, or run on a VM); otherwise "
    "unprivileged user namespaces: on Ubuntu >= 23.10 "
    "`sysctl kernel.apparmor_restrict_unprivileged_userns=0`, elsewhere "
    "`sysctl kernel.unprivileged_userns_clone=1`",
    "private_tmp": "a mount namespace (same requirement as the network namespace)",
    "reaping": "a PID namespace (user namespaces, as above) or PR_SET_CHILD_SUBREAPER (Linux)",
    "signals": "a PID namespace or Landlock ABI >= 6 (Linux >= 6.12)",
    "memory_cgroup": "a memory cgroup per run, limiting all of its processes together: the "
    "server must run as root (or own a delegated cgroup) with cgroup v1's memory hierarchy at "
    "/sys/fs/cgroup/memory, or cgroup v2 at /sys/fs/cgroup with the memory controller "
    "enabled in the server's parent cgroup.subtree_control (the kernel refuses to enable it "
    "where that cgroup holds processes itself and is not the root: delegate one, e.g. "
    "systemd's Delegate=yes, and start the trainer in a leaf of it)",
    "pids_cgroup": "a pids cgroup per run: as for memory_cgroup, with the pids controller",
    "cpu_cgroup": "a cpu cgroup per run (one equal CPU share each): as for memory_cgroup, with the cpu controller",
}


def missing_isolation(layers: Sequence[str], level: str, is_root: bool) -> list[str]:
    """Requirements of `level` that none of the active `layers` meets."""
    if level not in ISOLATION_LEVELS:
        raise ValueError(f"min_isolation must be one of {sorted(ISOLATION_LEVELS)}, got {level!r}")
    have = set(layers)
    missing = []
    for need in ISOLATION_LEVELS[level]:
        if need == "not_root" and not is_root:
            continue  # not root to begin with
        if not have.intersection(_REQUIREMENTS[need]):
            missing.append(need)
    return missing


def require_isolation(who: str, layers: Sequence[str], level: str, is_root: bool) -> None:
    """Raise `RuntimeError` when the active `layers` miss part of `level`, naming each missing
    requirement and how to get it; `who` (the component) starts the message."""
    missing = missing_isolation(layers, level, is_root)
    if missing:
        how = "\n".join(f"  - {m}: {_HOW_TO.get(m, 'see vapo_lightning/sandbox')}" for m in missing)
        raise RuntimeError(
            f"{who}: this machine's sandbox lacks what min_isolation={level!r} requires.\n"
            f"Active layers: {', '.join(layers)}.\nMissing:\n{how}\nFix the above, or lower "
            "min_isolation (e.g. 'basic') if you accept running model-written code with less "
            "isolation."
        )
