import ctypes
HALVES = @HALVES@
def f():
    found = set()
    with open('/proc/self/maps') as fh:
        maps = fh.read().splitlines()
    for line in maps:
        fields = line.split()
        name = fields[5] if len(fields) > 5 else ''
        if fields[1][0] != 'r' or name in ('[vvar]', '[vvar_vclock]', '[vsyscall]'):
            continue
        if name and not name.startswith('['):
            continue  # files: the interpreter and libraries, never a request
        lo, hi = (int(x, 16) for x in fields[0].split('-'))
        mem = ctypes.string_at(lo, hi - lo)
        for a, b in HALVES:
            i = mem.find(a)
            while i >= 0:
                if mem[i + len(a) : i + len(a) + len(b)] == b:
                    found.add(a.decode())
                i = mem.find(a, i + 1)
    return sorted(found)
