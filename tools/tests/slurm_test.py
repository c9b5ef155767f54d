#!/usr/bin/python3
"""The Slurm recipe, end to end: a private single-node Slurm (munged, slurmctld and slurmd in a
temporary directory, on free ports) runs tools/slurm/gen-array.sbatch as an array of 3 tasks,
then the merging gen without --shard as a job depending on it; the set equals, byte for byte, a
one-machine gen of the same spec. Exit 77 (skipped) with the reason where Slurm is not installed
or cannot start.

The test is its descendants' subreaper: the job steps (slurmstepd leaves slurmd's process tree)
are its children, and every one is stopped and reaped before it exits.

Usage: slurm_test.py ATTNORACLE_CLI SOURCE_DIR
"""
import ctypes
import filecmp
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time

SKIPPED = 77
UP_SECONDS = 30  # for a daemon to come up
JOB_SECONDS = 120  # for the array job
STOP_SECONDS = 10  # for a process to leave after SIGTERM

# A small spec: cheap cases of a few core families, forward and backward.
SPEC = """{"suite": "slurm", "seed": 7, "families": [
  {"name": "uniform", "generator": "uniform", "cross": {"dtype": ["F32", "F16", "BF16", "F64"]},
   "fixed": {"shape": [1, 1, 1, 4, 6, 4, 4], "outputs": "out,weights,lse"}},
  {"name": "causal", "generator": "normal",
   "cross": {"dtype": ["F32", "BF16"], "causal": ["top_left", "bottom_right"]},
   "fixed": {"shape": [1, 2, 1, 5, 3, 4, 4], "masked_rows": "zero", "outputs": "out,lse"}},
  {"name": "bwd", "generator": "normal", "cross": {"dtype": ["F32", "F16"]},
   "fixed": {"shape": [1, 2, 1, 4, 5, 4, 4], "outputs": "out,lse,dq,dk,dv"}}
]}
"""
CASES = 10
FIRST_TASK = 3  # the array is 3-5: the shard index is the task id minus the array's first
TASKS = 3

DAEMONS = ("munged", "slurmctld", "slurmd")
CLIENTS = ("sbatch", "squeue", "sinfo", "scontrol", "scancel")


class Skip(Exception):
    pass


class Failure(Exception):
    pass


def lines(path):
    try:
        with open(path, errors="replace") as f:
            return f.read().splitlines()
    except OSError:
        return ["(no log)"]


def tail(path, n=5):
    """The last lines of a log, on one line."""
    return " | ".join(lines(path)[-n:]) or "(empty)"


def daemon_log(tmp, name):
    """The end of a daemon's log file, or of its output where it wrote no log."""
    log = os.path.join(tmp, name + ".log")
    return tail(log if os.path.exists(log) else os.path.join(tmp, name + ".out"))


def free_ports(n):
    """n free TCP ports on the loopback, distinct (all held until every one is chosen)."""
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def children():
    """The processes whose parent is this one."""
    me, found = os.getpid(), []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    stat = f.read()
            except OSError:
                continue
            if int(stat[stat.rindex(")") + 2:].split()[1]) == me:  # field 4, after "(comm)"
                found.append(int(entry))
    return found


def reap():
    """Collects every child that has exited."""
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return


def stop_all_children():
    """SIGTERM to every child (orphaned descendants included), SIGKILL to those left, all reaped."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid in children():
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + STOP_SECONDS
        while time.monotonic() < deadline:
            reap()
            if not children():
                return
            time.sleep(0.05)


class Cluster:
    """munged, slurmctld and slurmd under a temporary directory."""

    def __init__(self, tmp):
        self.tmp = tmp
        self.daemons = []  # (name, Popen), in start order
        self.env = {k: v for k, v in os.environ.items()
                    if not re.match(r"(SLURM_|SBATCH_|SQUEUE_|SINFO_|ATTNORACLE_SHARD_)", k)}
        self.env["SLURM_CONF"] = os.path.join(tmp, "slurm.conf")
        self.node = socket.gethostname().split(".")[0]
        self.jobs = []  # ids of the jobs submitted

    def path(self, name):
        return os.path.join(self.tmp, name)

    def start(self, name, args):
        log = open(self.path(name + ".out"), "ab")
        self.daemons.append((name, subprocess.Popen(args, stdin=subprocess.DEVNULL, stdout=log,
                                                    stderr=subprocess.STDOUT, env=self.env)))
        log.close()

    def dead(self):
        """A message naming a daemon that has exited, or None."""
        for name, p in self.daemons:
            if p.poll() is not None:
                return f"{name} exited with status {p.returncode}: {daemon_log(self.tmp, name)}"
        return None

    def slurm(self, *args, check=True):
        r = subprocess.run(args, env=self.env, stdin=subprocess.DEVNULL, capture_output=True, text=True,
                           timeout=60)
        if check and r.returncode != 0:
            raise Failure(f"{' '.join(args)}: status {r.returncode}: {r.stderr.strip()}")
        return r.stdout

    def submit(self, env, *args):
        r = subprocess.run(["sbatch", "--parsable", *args], env=env, cwd=self.path("jobs"), capture_output=True,
                           text=True, timeout=60)
        job = r.stdout.strip().split(";")[0]
        if r.returncode != 0 or not job.isdigit():
            raise Failure(f"sbatch {' '.join(args)}: status {r.returncode}: {r.stderr.strip()}")
        self.jobs.append(job)

    def states(self, job):
        """{array task id, or None for a job that is no array: (JobState, ExitCode)}."""
        found = {}
        for line in self.slurm("scontrol", "-o", "show", "job", job).splitlines():
            task = re.search(r"\bArrayTaskId=(\d+)\b", line)
            state = re.search(r"\bJobState=(\S+)", line)
            code = re.search(r"\bExitCode=(\S+)", line)
            found[int(task[1]) if task else None] = (state[1] if state else "?", code[1] if code else "?")
        return found

    def up(self):
        # munged with its own key and socket: it signs Slurm's credentials. --force: the socket is in a
        # directory only this user enters, which munged refuses by default (it serves every user).
        with open(os.open(self.path("munge.key"), os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "wb") as f:
            f.write(os.urandom(1024))
        sock = self.path("munge.sock")
        self.start("munged", ["munged", "-F", "--force", f"--socket={sock}",
                              f"--key-file={self.path('munge.key')}", f"--pid-file={self.path('munged.pid')}",
                              f"--log-file={self.path('munged.log')}", f"--seed-file={self.path('munged.seed')}"])
        self.wait_for(lambda: os.path.exists(sock), "munged's socket")

        # The node as slurmd sees it (CPUs, sockets, memory), under this host's short name.
        hardware = subprocess.run(["slurmd", "-C"], env=self.env, capture_output=True, text=True).stdout
        hardware = re.sub(r"^NodeName=\S+ ", "", hardware.splitlines()[0] if hardware else "")
        if "CPUs=" not in hardware:
            raise Skip("slurmd -C printed no node description")
        ctld_port, slurmd_port = free_ports(2)
        user = subprocess.run(["id", "-un"], capture_output=True, text=True, check=True).stdout.strip()
        for d in ("state", "spool", "jobs"):
            os.mkdir(self.path(d))
        # Every file in the temporary directory; no cgroup, no accounting; the daemons run as this
        # user (root is not needed); a scheduling pass each second (tasks past the CPUs and the
        # merge wait for one; the default is a minute).
        with open(self.env["SLURM_CONF"], "w") as f:
            f.write(f"""ClusterName=attnoracle
SlurmctldHost={self.node}(127.0.0.1)
SlurmctldPort={ctld_port}
SlurmdPort={slurmd_port}
SlurmUser={user}
SlurmdUser={user}
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={sock}
StateSaveLocation={self.path('state')}
SlurmdSpoolDir={self.path('spool')}
SlurmctldPidFile={self.path('slurmctld.pid')}
SlurmdPidFile={self.path('slurmd.pid')}
SlurmctldLogFile={self.path('slurmctld.log')}
SlurmdLogFile={self.path('slurmd.log')}
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
SchedulerType=sched/builtin
SchedulerParameters=sched_interval=1
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
MpiDefault=none
MailProg=/bin/true
ReturnToService=2
MinJobAge=300
DependencyParameters=kill_invalid_depend
NodeName={self.node} NodeAddr=127.0.0.1 {hardware} State=UNKNOWN
PartitionName=gen Nodes={self.node} Default=YES MaxTime=INFINITE State=UP
""")
        self.start("slurmctld", ["slurmctld", "-D", "-c"])
        self.start("slurmd", ["slurmd", "-D", "-N", self.node])
        idle = lambda: self.slurm("sinfo", "-h", "-n", self.node, "-o", "%T", check=False).strip() == "idle"
        self.wait_for(idle, f"node {self.node} idle", both_logs=True)

    def wait_for(self, ready, what, both_logs=False):
        deadline = time.monotonic() + UP_SECONDS
        while not ready():
            message = self.dead()
            if message:
                raise Skip(message)
            if time.monotonic() > deadline:
                logs = ("slurmctld", "slurmd") if both_logs else (self.daemons[-1][0],)
                raise Skip(f"{what} not within {UP_SECONDS} s: " +
                           "; ".join(f"{n}: {daemon_log(self.tmp, n)}" for n in logs))
            time.sleep(0.1)

    def down(self):
        if self.jobs:
            self.slurm("scancel", *self.jobs, check=False)
        for name, p in reversed(self.daemons):  # slurmd, slurmctld, then munged
            if p.poll() is None:
                p.terminate()
                try:
                    p.wait(STOP_SECONDS)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait()
        stop_all_children()  # job steps and their commands, if any are left


def run(cli, src, tmp):
    for tool in DAEMONS + CLIENTS:
        if not shutil.which(tool):
            raise Skip(f"{tool} is not installed (Debian: apt-get install slurm-wlm)")
    spec = os.path.join(tmp, "spec.json")
    with open(spec, "w") as f:
        f.write(SPEC)
    sharded, single = os.path.join(tmp, "sharded"), os.path.join(tmp, "single")

    c = Cluster(tmp)
    try:
        c.up()
        # As the README gives it: the array, then the merge as a job that depends on it.
        start = time.monotonic()
        env = dict(c.env, SPEC=spec, OUT=sharded, ATTNORACLE=cli)
        c.submit(env, f"--array={FIRST_TASK}-{FIRST_TASK + TASKS - 1}", f"--output={c.path('jobs')}/task-%a.out",
                 os.path.join(src, "tools", "slurm", "gen-array.sbatch"))
        merge_log = c.path("jobs/merge.out")
        c.submit(env, f"--dependency=afterok:{c.jobs[0]}", f"--output={merge_log}",
                 "--wrap", " ".join(shlex.quote(a) for a in (cli, "gen", spec, "-o", sharded, "--no-progress")))
        deadline = time.monotonic() + JOB_SECONDS
        while c.slurm("squeue", "-h", "-j", ",".join(c.jobs), "-o", "%i").strip():
            if time.monotonic() > deadline:
                raise Failure(f"jobs {c.jobs} not done within {JOB_SECONDS} s: "
                              f"{c.slurm('squeue', '-j', ','.join(c.jobs), check=False)}")
            time.sleep(0.1)
        seconds = time.monotonic() - start

        # Every task completed with status 0, generated the shard its index names and no manifest.
        tasks = c.states(c.jobs[0])
        for i in range(TASKS):
            task = FIRST_TASK + i
            log = c.path(f"jobs/task-{task}.out")
            if tasks.get(task) != ("COMPLETED", "0:0"):
                raise Failure(f"array task {task}: {tasks.get(task)}, not COMPLETED 0:0: {tail(log)}")
            want = f"gen: shard {i}/{TASKS} (from SLURM_ARRAY_TASK_ID, SLURM_ARRAY_TASK_COUNT)"
            if want not in lines(log):
                raise Failure(f"array task {task} did not print '{want}': {tail(log)}")
            if not re.search(rf"; shard {i}/{TASKS} done, \d+ of {CASES} cases still missing; ", lines(log)[-1]):
                raise Failure(f"array task {task} did not end its shard without a manifest: {tail(log)}")

        # The merge evaluated nothing: every case was present.
        merge = c.states(c.jobs[1]).get(None)
        summary = f": 0 cases written, {CASES} already present, 0 failed; manifest written ({CASES} cases)"
        if merge != ("COMPLETED", "0:0") or not lines(merge_log)[-1].endswith(summary):
            raise Failure(f"the merge job ({merge}) did not find the {CASES} cases present: {tail(merge_log)}")
    finally:
        c.down()

    # One machine, no shards: the same files, byte for byte, and no other.
    subprocess.run([cli, "gen", spec, "-o", single, "--quiet"], check=True)
    files = []
    for d in (single, sharded):
        # (not the record of verified files: the identities of each set's own files)
        files.append(sorted(os.path.relpath(os.path.join(r, n), d) for r, _, ns in os.walk(d) for n in ns
                            if n != ".attnoracle-verified"))
    if files[0] != files[1]:
        raise Failure(f"different files: one run {files[0]}, sharded {files[1]}")
    if len(files[0]) != CASES + 1:
        raise Failure(f"expected {CASES} case files and the manifest, found {files[0]}")
    _, differ, errors = filecmp.cmpfiles(single, sharded, files[0], shallow=False)
    if differ or errors:
        raise Failure(f"files that differ: {differ + errors}")
    return seconds


def main(argv):
    if len(argv) != 3:
        print("usage: slurm_test.py ATTNORACLE_CLI SOURCE_DIR", file=sys.stderr)
        return 2
    cli, src = os.path.realpath(argv[1]), os.path.realpath(argv[2])
    os.environ["PATH"] += ":/usr/sbin:/sbin"  # the daemons, for a user whose PATH lacks them
    # Orphaned descendants (job steps) become this process's children, so none outlives it.
    PR_SET_CHILD_SUBREAPER = 36
    if ctypes.CDLL(None, use_errno=True).prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) != 0:
        print(f"slurm test: skipped: prctl(PR_SET_CHILD_SUBREAPER): {os.strerror(ctypes.get_errno())}")
        return SKIPPED
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(1))  # cleanup runs on SIGTERM, as on Ctrl-C
    tmp = tempfile.mkdtemp(prefix="attnoracle-slurm.", dir="/tmp")  # a socket path has at most 107 bytes
    try:
        seconds = run(cli, src, tmp)
    except Skip as e:
        print(f"slurm test: skipped: {e}")
        return SKIPPED
    except Failure as e:
        print(f"slurm test: FAILED: {e}", file=sys.stderr)
        return 1
    finally:
        stop_all_children()
        shutil.rmtree(tmp, ignore_errors=True)
    print(f"slurm test: passed ({CASES} cases over {TASKS} array tasks, identical to one run; "
          f"jobs {seconds:.1f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
