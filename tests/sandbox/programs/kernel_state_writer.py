import ctypes, socket
def f():
    try:
        s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    except PermissionError:
        s = None
    for _ in range(37 if s else 0):
        try: s.sendto(b'x', ('127.0.0.1', 9))
        except OSError: pass
    libc = ctypes.CDLL(None, use_errno=True)
    key = libc.syscall(@ADD_KEY@, b'user', b'vapo-leak', b'run-1', 5, -4)
    return ['sent' if s else 'refused', 'written' if key > 0 else 'no key']
