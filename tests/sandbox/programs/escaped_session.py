import subprocess
def f():
    subprocess.Popen(['sleep', '600'], start_new_session=True)
    return 0
