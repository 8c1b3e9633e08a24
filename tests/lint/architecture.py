#!/usr/bin/env python3
"""Architecture checks run by `make lint`, for worker/src and operator/src:

- no import cycles: at every level of the module tree, the graph among a module's direct
  children (a child stands for its whole subtree) has no cycle. A reference is any
  `crate::a::b` or `super::x` path in the source, doc links included; a child's references to
  items of its own parent do not count (that is how Rust nests modules);
- no function over 100 lines (test modules after `#[cfg(test)]` aside).

Exits 1 naming each cycle (with one file and line per edge) and each long function.
Usage: tests/lint/architecture.py [SRC_DIR ...]   (default: worker/src operator/src)
"""
import os
import re
import sys
from collections import defaultdict

MAX_FN_LINES = 100
PATH = re.compile(r"\b(crate|super)((?:::[A-Za-z_][A-Za-z0-9_]*)+|::\{[^}]*\})")
GROUP = re.compile(r"\b(crate|super)::\{([^;]*?)\}\s*;", re.S)
FN = re.compile(r"\s*(pub(\([a-z:\s]+\))?\s+)?(const\s+)?(async\s+)?(unsafe\s+)?fn\s+\w+")


def module_path(src, path):
    rel = os.path.relpath(path, src)[:-3].split(os.sep)
    if rel[-1] in ("mod", "lib", "main"):
        rel = rel[:-1]
    return tuple(rel)


def code_of(text):
    """The file without its test module (everything from `#[cfg(test)]` on)."""
    return text.split("#[cfg(test)]")[0]


def references(text):
    """(line, kind, [segment, ...]) for each crate::/super:: path, groups expanded."""
    out = []
    for m in GROUP.finditer(text):
        line = text.count("\n", 0, m.start()) + 1
        for item in re.split(r",", m.group(2)):
            segs = [s for s in re.split(r"::", item.strip().split(" as ")[0]) if s and s != "{"]
            segs = [re.sub(r"[{}\s]", "", s) for s in segs]
            if segs and segs[0]:
                out.append((line, m.group(1), segs))
    for m in PATH.finditer(text):
        if m.group(2).startswith("::{"):
            continue
        line = text.count("\n", 0, m.start()) + 1
        out.append((line, m.group(1), m.group(2).split("::")[1:]))
    return out


def resolve(modules, here, is_mod_file, kind, segs):
    """The module a path points into (longest known prefix), or None."""
    if kind == "crate":
        base = ()
    else:
        # `super` in a/b.rs or a/b/mod.rs is module a.
        base = here[:-1]
        while segs and segs[0] == "super":
            base, segs = base[:-1], segs[1:]
    best = None
    for i in range(len(segs) + 1):
        cand = base + tuple(segs[:i])
        if cand in modules:
            best = cand
    return best


def cycles_in(graph):
    """Every elementary cycle found by a DFS (enough to name them)."""
    found, state, stack = [], {}, []

    def dfs(n):
        state[n] = 1
        stack.append(n)
        for m in sorted(graph.get(n, ())):
            if state.get(m) == 1:
                found.append(stack[stack.index(m):] + [m])
            elif not state.get(m):
                dfs(m)
        stack.pop()
        state[n] = 2

    for n in sorted(graph):
        if not state.get(n):
            dfs(n)
    return found


def check_cycles(src):
    files = {}
    for root, _, names in os.walk(src):
        for name in names:
            if name.endswith(".rs"):
                p = os.path.join(root, name)
                files[p] = module_path(src, p)
    modules = set(files.values())
    for m in list(modules):
        for i in range(len(m)):
            modules.add(m[:i])
    # edges[parent][(a, b)] = example "file:line"
    edges = defaultdict(dict)
    for path, here in files.items():
        text = code_of(open(path, encoding="utf-8", errors="replace").read())
        for line, kind, segs in references(text):
            target = resolve(modules, here, path.endswith("mod.rs"), kind, segs)
            if target is None:
                continue
            # The deepest common ancestor: the level at which this is an edge between siblings.
            k = 0
            while k < min(len(here), len(target)) and here[k] == target[k]:
                k += 1
            if k >= len(here) or k >= len(target):
                continue  # a module and its own ancestor or descendant
            parent = here[:k]
            edges[parent].setdefault((here[k], target[k]), f"{os.path.relpath(path)}:{line}")
    problems = []
    for parent, es in sorted(edges.items()):
        graph = defaultdict(set)
        for a, b in es:
            graph[a].add(b)
        for cycle in cycles_in(graph):
            where = "::".join(parent) or "crate root"
            hops = ", ".join(f"{a} -> {b} ({es[(a, b)]})" for a, b in zip(cycle, cycle[1:]))
            problems.append(f"{src}: import cycle among the children of {where}: {hops}")
    return problems


def check_lengths(src):
    problems = []
    for root, _, names in os.walk(src):
        for name in sorted(names):
            if not name.endswith(".rs"):
                continue
            path = os.path.join(root, name)
            lines = code_of(open(path, encoding="utf-8", errors="replace").read()).split("\n")
            i = 0
            while i < len(lines):
                if FN.match(lines[i]) and not lines[i].rstrip().endswith(";"):
                    depth, j, opened = 0, i, False
                    while j < len(lines):
                        depth += lines[j].count("{") - lines[j].count("}")
                        opened = opened or "{" in lines[j]
                        if opened and depth <= 0:
                            break
                        j += 1
                    if j - i + 1 > MAX_FN_LINES:
                        problems.append(f"{os.path.relpath(path)}:{i + 1}: a function of {j - i + 1} lines (at most {MAX_FN_LINES})")
                    i = j + 1
                else:
                    i += 1
    return problems


def main(args):
    srcs = args or ["worker/src", "operator/src"]
    problems = []
    for src in srcs:
        problems += check_cycles(src) + check_lengths(src)
    for p in problems:
        print(p)
    if problems:
        print(f"architecture: {len(problems)} problem(s)", file=sys.stderr)
        return 1
    print(f"architecture: no import cycle, no function over {MAX_FN_LINES} lines in {' '.join(srcs)}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
