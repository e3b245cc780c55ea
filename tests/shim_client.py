"""A stand-in for ``python``, ``fairseq-train``, ``fairseq-validate`` or ``acl-fairseq-NAME``
(its name says which): the command runs in the fork server of tests/fork_server.py, with this
process's arguments, environment, working folder, standard streams and file-size limit; this
process forwards SIGINT, SIGTERM and SIGHUP to it and ends as it ends (its exit code, or killed
by its signal). Imports nothing beyond the standard library's sockets, so it starts in
milliseconds."""

import json
import os
import resource
import signal
import socket
import struct
import sys


def main() -> None:
    here, name = os.path.split(os.path.abspath(sys.argv[0]))
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.connect(os.path.join(here, "server.sock"))
    except OSError as e:
        sys.exit(f"{name}: the tests' fork server is not running ({e})")
    fds = []
    for fd in (0, 1, 2):
        try:
            os.fstat(fd)
            fds.append(fd)
        except OSError:  # a closed stream: the command gets /dev/null
            fds.append(os.open(os.devnull, os.O_RDWR))
    request = {"name": name, "args": sys.argv[1:], "env": dict(os.environ), "cwd": os.getcwd(),
               "fsize": resource.getrlimit(resource.RLIMIT_FSIZE)}  # fmt: skip
    data = json.dumps(request).encode()
    socket.send_fds(sock, [struct.pack("!Q", len(data))], fds)
    sock.sendall(data)
    answers = sock.makefile("rb")
    pid = json.loads(answers.readline())["pid"]
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, lambda number, _frame: os.kill(pid, number))
    line = answers.readline()
    if not line:
        sys.exit(f"{name}: the tests' fork server went away")
    code = json.loads(line)["rc"]
    if code < 0:  # killed by a signal: so is this process
        if -code not in (signal.SIGKILL, signal.SIGSTOP):
            signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
    sys.exit(code)


main()
