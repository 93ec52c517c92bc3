#!/usr/bin/env python3
"""Where a staged transfer's time goes, from the step traces of a job's staging agents.

Run the job with MESHMEM_STAGED_TRACE=PREFIX (each rank's agent writes PREFIX.<rank> when it
ends), then:  bench/agent_trace.py PREFIX [--skip 10]

Steps (comm/src/cuda/staging_agent.hpp): S handed over by the caller, R its source seen ready,
P its copy into a slot enqueued, O posted on the channel (the writer's agent); I the descriptor
seen, E carried out (the reader's agent). All times are one host's CLOCK_MONOTONIC, so the
reader's steps line up with the writer's. For each rank as the writer of its transfers (the
first --skip percent left out as warm-up), the median, p10 and p90 in microseconds of:
  handed over -> source ready     how far the caller runs ahead of its GPU
  source ready -> copy enqueued   the agent's turn, and work before it (other transfers)
  copy enqueued -> posted         the writer's driver calls (copy, event, stream write)
  posted -> seen by the reader    the copy on the GPU, the count's write, the reader's poll
  seen -> carried out             the reader's driver calls (copy, stream writes)
  source ready -> carried out     the whole handover, writer to reader
A transfer of several pieces counts its first P and I and its last O and E.
Then, per rank as a reader, how many descriptors each batch it enqueued held (step L: one look
at its channels, enqueued as one copy batch and one batch of stream writes).
"""
import glob
import os
import statistics
import sys


def read(path):
    steps = []
    with open(path) as f:
        for line in f:
            if line.startswith('#'):
                continue
            ns, step, peer, ident, aux = line.split()
            steps.append((int(ns), step, int(peer), int(ident), int(aux)))
    return steps


def summary(values):
    if not values:
        return '%8s %8s %8s %7s' % ('-', '-', '-', 0)
    v = sorted(values)
    pick = lambda q: v[min(len(v) - 1, int(q * len(v)))] / 1e3
    return '%8.1f %8.1f %8.1f %7d' % (statistics.median(v) / 1e3, pick(0.1), pick(0.9), len(v))


def main(argv):
    if len(argv) < 2 or argv[1] in ('-h', '--help'):
        print(__doc__)
        return 0 if len(argv) >= 2 else 2
    prefix, skip = argv[1], 10.0
    if len(argv) == 4 and argv[2] == '--skip':
        skip = float(argv[3])
    elif len(argv) != 2:
        print('usage: agent_trace.py PREFIX [--skip PERCENT]', file=sys.stderr)
        return 2
    files = {}
    for path in glob.glob(glob.escape(prefix) + '.*'):
        suffix = path[len(prefix) + 1:]
        if suffix.isdigit():
            files[int(suffix)] = path
    if not files:
        print('agent_trace.py: no %s.<rank> files' % prefix, file=sys.stderr)
        return 1
    # writer[(rank, ticket)] = {step: ns}; reader[(writer, ticket)] = {step: ns} for its own puts
    writer, reader = {}, {}
    looks = {}  # looks[rank][descriptors] = batches
    for rank, path in sorted(files.items()):
        for ns, step, peer, ident, aux in read(path):
            if step == 'L':
                per = looks.setdefault(rank, {})
                per[ident] = per.get(ident, 0) + 1
            elif step in 'SRPO':
                w = writer.setdefault((rank, ident), {})
                if step in 'SRP':
                    w.setdefault(step, ns)
                else:
                    w[step] = ns
            elif step in 'IE' and aux == peer:  # the writer's own transfer (not an answer to a get)
                r = reader.setdefault((peer, ident), {})
                if step == 'I':
                    r.setdefault(step, ns)
                else:
                    r[step] = ns
    spans = [
        ('handed over -> source ready', lambda w, r: w['R'] - w['S']),
        ('source ready -> copy enqueued', lambda w, r: w['P'] - w['R']),
        ('copy enqueued -> posted', lambda w, r: w['O'] - w['P']),
        ('posted -> seen by the reader', lambda w, r: r['I'] - w['O']),
        ('seen -> carried out', lambda w, r: r['E'] - r['I']),
        ('source ready -> carried out', lambda w, r: r['E'] - w['R']),
    ]
    print('# %s: %d rank(s); per writer rank, microseconds (median, p10, p90, transfers); first %g %% skipped'
          % (prefix, len(files), skip))
    print('%-5s %-32s %8s %8s %8s %7s' % ('# rank', 'span', 'median', 'p10', 'p90', 'count'))
    for rank in sorted(files):
        tickets = sorted(t for (w, t) in writer if w == rank)
        tickets = tickets[int(len(tickets) * skip / 100):]
        for name, span in spans:
            values = []
            for t in tickets:
                w, r = writer[(rank, t)], reader.get((rank, t), {})
                try:
                    values.append(span(w, r))
                except KeyError:
                    pass  # a step of it is not in the trace (a get, a refused or abandoned one)
            print('%-6d %-32s %s' % (rank, name, summary(values)))
    print('# descriptors per batch the reader enqueued (one look at its channels): count of batches')
    for rank in sorted(looks):
        print('%-6d %s' % (rank, '  '.join('%d: %d' % (k, v) for k, v in sorted(looks[rank].items()))))
    return 0


if __name__ == '__main__':
    sys.exit(main(sys.argv))
