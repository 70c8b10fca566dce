import os
def f():
    try: os.kill(-1, 9)
    except OSError: pass
    os.killpg(0, 9)
