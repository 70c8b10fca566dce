import sys
def f():
    while True: sys.stderr.write('x' * 10 ** 6)
