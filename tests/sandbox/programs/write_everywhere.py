HOME = @HOME@
for p in @CANARIES@ + [HOME + '/pwned', '/root/.bashrc']:
    try:
        with open(p, 'a') as fh:
            fh.write('pwned')
    except Exception:
        pass
def f():
    return 0
