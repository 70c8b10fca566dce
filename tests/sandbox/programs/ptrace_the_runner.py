import ctypes, os
r = ctypes.CDLL(None, use_errno=True).syscall(@PTRACE@, 16, os.getppid(), 0, 0)
print('attached' if r == 0 else 'refused')
