def probe():
    ip = [line.split() for line in open('/proc/net/snmp') if line.startswith('Ip:')]
    no_route = dict(zip(*ip))['OutNoRoutes']
    libc = ctypes.CDLL(None, use_errno=True)
    found = libc.syscall(@KEYCTL@, 10, ctypes.c_long(-4), b'user', b'vapo-leak', 0)
    return [no_route, found > 0]
