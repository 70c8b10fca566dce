import sys
sys.setrecursionlimit(10 ** 9)
def f(n=0):
    return f(n + 1)
