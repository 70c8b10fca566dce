import os, time
HOME = @HOME@
def f():
    if os.fork() == 0:
        os.setsid()
        if os.fork() == 0:
            time.sleep(0.5)
            for p in @CANARIES@ + [HOME + '/pwned', '/root/.bashrc']:
                try:
                    with open(p, 'a') as fh:
                        fh.write('daemon')
                except Exception:
                    pass
            time.sleep(600)
        os._exit(0)
    return 0
