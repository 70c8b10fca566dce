def f():
    return open(@REPO_FILE@).read()
