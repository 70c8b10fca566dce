import fcntl, os, time
def f():
    held = []
    while True:
        r, w = os.pipe()
        os.close(r)
        try:
            fcntl.fcntl(w, fcntl.F_SETPIPE_SZ, 1 << 20)
        except OSError:
            break
        held.append(w)
    time.sleep(4)
    return len(held) > 10
