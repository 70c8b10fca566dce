import ctypes, errno, socket
def attempt(fn):
    try:
        fn()
        return 'ok'
    except OSError as e:
        return errno.errorcode.get(e.errno, str(e.errno))
def f():
    a, b = socket.socketpair()
    libc = ctypes.CDLL(None, use_errno=True)
    def io_uring():
        if libc.syscall(425, 8, None) < 0:
            raise OSError(ctypes.get_errno(), 'io_uring_setup')
    def add_key():
        if libc.syscall(@ADD_KEY@, b'user', b'k', b'v', 1, -4) < 0:
            raise OSError(ctypes.get_errno(), 'add_key')
    return {
        'inet': attempt(lambda: socket.socket(socket.AF_INET, socket.SOCK_DGRAM)),
        'netlink': attempt(lambda: socket.socket(socket.AF_NETLINK, socket.SOCK_RAW)),
        'pair_inet': attempt(lambda: socket.socketpair(socket.AF_INET)),
        'host_unix': attempt(lambda: socket.socket(socket.AF_UNIX).connect(
            '\0vapo-test-@TOKEN@')),
        'send_fds': attempt(lambda: socket.send_fds(a, [b'x'], [0])),
        'io_uring': attempt(io_uring),
        'add_key': attempt(add_key),
        'pair': attempt(lambda: a.send(b'x') == 1 and b.recv(1) == b'x' or 1 / 0),
    }
