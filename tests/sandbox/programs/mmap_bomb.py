import mmap
def f():
    m = mmap.mmap(-1, 1 << 36)
    return len(m)
