import sys
sys.exit(0)
def f():
    return 0
