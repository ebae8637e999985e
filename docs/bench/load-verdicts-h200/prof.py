"""Sample the target and coordinator processes with py-spy once the target has served 300 forwards."""
import re, subprocess, sys, time, urllib.request, os

out = os.environ["OUT"]
def pid(name):
    for _ in range(3000):
        r = subprocess.run(["pgrep", "-f", f"serve {name}"], capture_output=True, text=True).stdout.split()
        if r:
            return int(r[0])
        time.sleep(0.1)
tp = pid("target")
port = re.search(r"--metrics-port\x00(\d+)", open(f"/proc/{tp}/cmdline").read()).group(1)
while True:
    try:
        text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2).read().decode()
        m = re.search(r"^specd_verify_batch_size_count\{[^}]*\} (\S+)", text, re.M)
        if m and float(m.group(1)) > 300:
            break
    except OSError:
        pass
    time.sleep(0.1)
cp = pid("coordinator")
procs = [subprocess.Popen(["/tmp/site/bin/py-spy", "record", "-p", str(p), "-d", "5", "-r", "250", "-f", "raw",
                           "-o", f"{out}/{n}-{sys.argv[1]}.txt", "--nonblocking"], stdout=subprocess.DEVNULL)
         for n, p in (("target", tp), ("coordinator", cp))]
for p in procs:
    p.wait()
