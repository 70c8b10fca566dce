import signal
for s in (signal.SIGTERM, signal.SIGINT, signal.SIGALRM, signal.SIGXCPU, signal.SIGHUP):
    signal.signal(s, signal.SIG_IGN)
def f():
    while True: pass
