#!/usr/bin/env python3
"""bench/agent_trace.py on a made-up two-rank trace whose spans are known: rank 0 puts 20
transfers to rank 1 (handed over -> ready 1 us, ready -> copy 2, copy -> posted 3, posted ->
seen 4, seen -> carried out 5 at rank 1; the odd ones in two pieces, whose first P and I and
last O and E count), and rank 1 answers a get of rank 0's after each even one (its I/E steps
carry rank 0's ticket but not as rank 0's own put: not counted). Exit 0 when every span's
median, p10 and p90 are as made."""
import os
import subprocess
import sys
import tempfile


def main(script):
    with tempfile.TemporaryDirectory() as d:
        prefix = os.path.join(d, 'trace')
        w, r = ['# meshmem step trace: made up'], ['# meshmem step trace: made up']
        for t in range(1, 21):
            base = t * 1_000_000
            w += ['%d S 1 %d 0' % (base, t), '%d R 1 %d 0' % (base + 1000, t), '%d P 1 %d 4096' % (base + 3000, t)]
            if t % 2 == 1:  # two pieces
                w += ['%d O 1 %d 0' % (base + 4000, t), '%d P 1 %d 4096' % (base + 5000, t)]
                r += ['%d I 0 %d 0' % (base + 10000, t), '%d E 0 %d 0' % (base + 10500, t)]
                r += ['%d I 0 %d 0' % (base + 12000, t)]
            else:
                r += ['%d I 0 %d 0' % (base + 10000, t)]
            w += ['%d O 1 %d 1' % (base + 6000, t)]
            r += ['%d E 0 %d 0' % (base + 15000, t)]
            if t % 2 == 0:  # a get's answer with rank 0's ticket t: aux 1, not rank 0's own put
                r += ['%d I 0 %d 1' % (base + 500_000, t), '%d E 0 %d 1' % (base + 600_000, t)]
        with open(prefix + '.0', 'w') as f:
            f.write('\n'.join(w) + '\n')
        with open(prefix + '.1', 'w') as f:
            f.write('\n'.join(r) + '\n')
        out = subprocess.run([sys.executable, script, prefix, '--skip', '0'], capture_output=True, text=True)
        if out.returncode != 0:
            print(out.stdout, out.stderr)
            return 1
        want = {'handed over -> source ready': 1.0, 'source ready -> copy enqueued': 2.0,
                'copy enqueued -> posted': 3.0, 'posted -> seen by the reader': 4.0,
                'seen -> carried out': 5.0, 'source ready -> carried out': 14.0}
        got = {}
        for line in out.stdout.splitlines():
            if line.startswith('0 '):
                fields = line.split()
                name = ' '.join(fields[1:-4])
                got[name] = (float(fields[-4]), float(fields[-3]), float(fields[-2]), int(fields[-1]))
        ok = True
        for name, median in want.items():
            if got.get(name) != (median, median, median, 20):
                print('%s: got %s, want median, p10 and p90 %.1f over 20 transfers' % (name, got.get(name), median))
                ok = False
        print(out.stdout if not ok else 'agent_trace.py: every span as made')
        return 0 if ok else 1


if __name__ == '__main__':
    sys.exit(main(sys.argv[1]))
