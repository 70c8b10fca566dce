import fcntl, os
def f():
    r, w = os.pipe()
    try:
        return fcntl.fcntl(w, fcntl.F_SETPIPE_SZ, 1 << 20)
    except OSError as err:
        return str(err)
