import ctypes, os, socket, time
def f():
    open('/tmp/leak', 'w').write('L')
    if ctypes.CDLL(None).shmget(4567, 4096, 0o1666) < 0: return 'no shm'
    open('/dev/shm/leak', 'w').write('L')
    open('leak', 'w').write('L')
    r, w = os.pipe()
    if os.fork() == 0:
        os.setsid()
        try:
            u = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
            u.bind(('0.0.0.0', 45678))
            a = socket.socket(socket.AF_UNIX)
            a.bind('\0vapo-leak')
            a.listen()
        except PermissionError:  # no_sockets: nothing to hold
            pass
        os.write(w, b'k')
        time.sleep(600)
    os.read(r, 1)
    return 'written'
