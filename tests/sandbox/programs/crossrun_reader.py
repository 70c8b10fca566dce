import ctypes, os, socket
def f():
    for p in ('/tmp/leak', '/dev/shm/leak', 'leak'):
        if os.path.exists(p): return 'L'
    if ctypes.CDLL(None).shmget(4567, 0, 0) >= 0: return 'L'
    try:
        u = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        a = socket.socket(socket.AF_UNIX)
    except PermissionError:  # no_sockets: nothing could have been held either
        return 'clean'
    u.bind(('0.0.0.0', 45678))
    try:
        a.connect('\0vapo-leak')
        return 'L'
    except OSError:
        pass
    a.bind('\0vapo-leak')
    return 'clean'
