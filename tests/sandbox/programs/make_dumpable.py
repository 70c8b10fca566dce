import ctypes, resource, subprocess, sys
def f():
    libc = ctypes.CDLL(None, use_errno=True)
    before = libc.prctl(3, 0, 0, 0, 0)
    libc.prctl(4, 1, 0, 0, 0)
    after = libc.prctl(3, 0, 0, 0, 0)
    child = subprocess.run([sys.executable, '-c', 'import resource; print(resource.getrlimit(resource.RLIMIT_CORE))'], capture_output=True, text=True)
    return [before, after, child.stdout.strip()]
