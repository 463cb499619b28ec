"""Segments: sections of a walk that run inside one worker without a parent round trip per node.

A walk section whose nodes all sit on one worker rank -- a chain of nodes, a Loop or
DynamicLoop with its whole body, or a Sequential / Parallel of such -- becomes one *segment*.
The parent's model view runs a stand-in node in its place (reading what the section reads from
outside, making what the section leaves visible after it); the worker runs the section with an
in-process Runtime (placement/segment_runner.py) and reports once, at the segment's end, while
EMITted outputs travel to the parent as they are made.

Both processes compute the same segments from the model and the node ranks
(:func:`find_segments`), so nothing but the node names crosses to agree on them (the worker's
``ready`` lists them and the parent checks).

A stateful engine's nodes (a KV cache, whose pages a request's walks share) join segments when
the engine keeps per-request state under ``RequestContext.cache_id`` (``Engine.keys_by_cache_id``)
and every one of its nodes, wherever a walk runs it, can sit in a segment of one worker -- alone
if need be: the worker then serves all of that engine's work through one Runtime whose runs of a
request share the request's cache id (placement/segment_runner.py). An engine whose walks sit on
two workers (prefill on one, decode on another: placement/kv_moves.py) does the same on each: the
request's K/V move between the two workers' engines at the walk change. Otherwise the engine's
nodes keep the per-node path.

A stream whose producer and consumer sit in one segment is the segment Runtime's own (its chunk
policy, windows and end as in one process). A stream leaving a segment (its consumer elsewhere)
leaves through the stand-in: the worker sends each item as it is made and the parent appends it
to the stand-in's stream (``Conductor.push_stream``), which the stand-in's end ends -- so the
segment must hold the producer's whole scope (the innermost loop around it, if any) and end
with it (else the stream would end later than in one process, holding its consumer back). A
stream entering a segment (its producer elsewhere) enters through the stand-in: the parent's
producer streams to the stand-in instead, which takes the stream whole, one item per window;
each window crosses to the worker as it comes and is pushed into a source node that stands for
the producer in the worker's Runtime (placement/stream_in.py), so the consumer's own chunk
policy cuts its windows there, as in one process. Such a stand-in sits in no loop of the walk (one run of it
reads the whole stream), and the producer and consumer run in no other walk (the producer's edge
is redirected to the stand-in).

A walk with Parts that runs whole on one worker is one segment, its Parts' sub-walks chosen in
the worker; otherwise each sub-walk of a Part is searched like any section (the parent chooses
the sub-walks).

Where a segment would change what a node sees, the per-node path stays: a node that keeps
per-request state ``cleanup`` drops (unless it keys it by cache id), a stream entering the
section inside a loop, one leaving it from inside a loop the section does not hold, a Loop with
``accumulated_outputs``, and, inside a loop that runs in the
parent (its iterations and stops are the parent's), anything but a fixed Loop whose nodes stop
no loop (a code predictor's steps inside a talker's decode loop: one run per outer iteration);
nor a stream entering a section inside a loop, or one that would need a Loop around it. A
segment of one node gains nothing and is not made, except for a stateful engine's node.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Collection, Mapping, Optional

from mstar_rt.graph import (EMIT, DynamicLoop, GraphEdge, GraphNode, Loop, Parallel, Part,
                            SectionLike, Sequential, StreamingGraphEdge)
from mstar_rt.model import Model, NodeSubmodule, node_engines, node_submodules
from mstar_rt.nodes import overrides
from mstar_rt.streaming import Fixed

SEGMENT_ENGINE = "segment@rank{rank}"


@dataclass(frozen=True)
class Segment:
    """One section of walk ``walk`` that runs whole in worker ``rank``."""

    name: str                      # the stand-in node's name in the parent's model view
    walk: str
    rank: int
    section: SectionLike
    nodes: tuple[str, ...]
    inputs: tuple[str, ...]        # what it reads from outside
    outputs: tuple[Any, ...]       # the stand-in's outputs: what it leaves visible after it
    engines: tuple[str, ...] = ()  # the stateful engines its nodes use (shared across runs)
    pushes: tuple[str, ...] = ()   # streams leaving it: each item crosses as it is made
    # streams entering it, by name: (producer, its edge to the consumer inside)
    takes: tuple[tuple[str, StreamingGraphEdge], ...] = ()

    @property
    def reads(self) -> tuple[str, ...]:
        """The stand-in's inputs: what it reads from outside, then the streams entering it (its
        windows come in this order)."""
        return self.inputs + tuple(e.name for _, e in self.takes)

    @property
    def stream_input(self) -> Any:
        """None, the one stream it takes, or a tuple of them (as NodeEntry.stream_input)."""
        names = tuple(e.name for _, e in self.takes)
        return None if not names else names[0] if len(names) == 1 else names


@dataclass
class SegmentPlan:
    segments: list[Segment]
    walks: dict[str, SectionLike]  # the walks with each segment replaced by its stand-in
    # (consumer, stream name) -> the stand-in that takes that stream in its place
    redirect: dict[tuple[str, str], str] = dataclasses.field(default_factory=dict)

    def edge(self, o: Any) -> Any:
        """An output of the parent's model view: a stream to a node inside a segment goes to
        its stand-in, one item per window."""
        if isinstance(o, StreamingGraphEdge) and (o.to, o.name) in self.redirect:
            return StreamingGraphEdge(self.redirect[(o.to, o.name)], o.name, Fixed(1))
        return o


def find_segments(model: Model, node_rank: Mapping[str, int], workers: set[int],
                  moving: Collection[str] = ()) -> SegmentPlan:
    """The segments of every walk of ``model`` and the rewritten walks.
    ``moving``: KV engines whose walks sit on different workers, a request's K/V moving between
    them at the walk change (placement/kv_moves.py): each worker's walks of such an engine may
    be its segments."""
    finder = _Finder(model, node_rank, workers, moving)
    while True:
        walks = {}
        finder.segments = []
        for walk, root in model.walks.items():
            finder.walk, finder.count = walk, 0
            finder.looped = _looped(root)
            finder.made = {n: set(finder.nodes[n].output_names)
                           for n in section_nodes(root, True)}
            finder.exported = _exported(root)
            walks[walk] = finder.rewrite_walk(root)
        # A stateful engine with a node left outside every segment keeps the per-node path
        # whole: its state lives in one place.
        left = {n for w in walks.values() for n in section_nodes(w, parts=True)}
        lost = {e for e, nodes in finder.shared.items() if nodes & left}
        if not lost:
            plan = SegmentPlan(finder.segments, walks,
                               {(e.to, e.name): s.name for s in finder.segments
                                for _, e in s.takes})
            plan.segments = [dataclasses.replace(s, outputs=tuple(plan.edge(o) for o in s.outputs))
                             for s in plan.segments]
            return plan
        finder.drop(lost)


def stand_in_nodes(segments: list[Segment]) -> list[GraphNode]:
    return [GraphNode(s.name, s.reads, s.outputs) for s in segments]


class _Finder:
    def __init__(self, model: Model, node_rank: Mapping[str, int], workers: set[int],
                 moving: Collection[str] = ()) -> None:
        self.nodes = {n.name: n for n in model.nodes}
        self.rank = {n: r for n, r in node_rank.items() if r in workers}
        subs, engines = node_submodules(model), node_engines(model)
        # each stream's edge by (producer, consumer): a segment holds its consumer only with
        # its producer
        self.streams = {(n.name, o.to): o for n in model.nodes for o in n.outputs
                        if isinstance(o, StreamingGraphEdge)}
        self.consumes = {(o.to, o.name) for n in model.nodes for o in n.outputs
                         if isinstance(o, StreamingGraphEdge)}  # (consumer, stream name)
        fits = {n.name for n in model.nodes
                if n.name in self.rank and (not overrides(subs[n.name], "cleanup", NodeSubmodule)
                                            or subs[n.name].cleanup_by_cache_id)}
        specs = model.engine_specs
        self.engine_of = engines
        self.eligible = {n for n in fits if engines[n] not in specs}
        self.stops = {n: overrides(subs[n], "check_stop", NodeSubmodule) for n in subs}
        # stateful engine -> its nodes, when they may all join segments of one worker
        self.shared: dict[str, set[str]] = {}
        for e, spec in specs.items():
            members = {n.name for n in model.nodes if engines[n.name] == e}
            if (getattr(spec, "keys_by_cache_id", False) and members and members <= fits
                    and (e in moving or len({self.rank[n] for n in members}) == 1)):
                self.shared[e] = members
                self.eligible |= members
        self.persisted = {o.name for n in model.nodes for o in n.outputs
                          if isinstance(o, GraphEdge) and o.persist}
        # What a segment must send back: names read outside it or kept for later walks (a
        # walk's end keeps only those: next_walk sees no other value).
        self.readers = {n.name: set(n.inputs) for n in model.nodes}
        self.walks_of: dict[str, set[str]] = {}
        for walk, root in model.walks.items():
            for n in section_nodes(root, True):
                self.walks_of.setdefault(n, set()).add(walk)
        self.segments: list[Segment] = []
        self.walk, self.count = "", 0
        self.looped: set[str] = set()  # the nodes inside a loop of the walk being rewritten
        self.made: dict[str, set[str]] = {}  # its nodes' output names
        self.exported: set[str] = set()  # what its loops hand on (outputs, accumulated)

    # ---- which rank runs a section whole ---------------------------------------------------

    def whole_rank(self, s: SectionLike, parts: bool = False) -> Optional[int]:
        """The worker rank that can run ``s`` as one segment, or None; with ``parts`` a Part
        whose every sub-walk can counts too."""
        if isinstance(s, str):
            return self.rank.get(s) if s in self.eligible else None
        if isinstance(s, Part):
            walks = list(s.walks.values()) if parts and isinstance(s.walks, Mapping) else []
            ranks = {self.whole_rank(w, parts) for w in walks}
            return ranks.pop() if len(ranks) == 1 else None
        if isinstance(s, Loop):
            return None if s.accumulated_outputs else self.whole_rank(s.section, parts)
        members = s.parts if isinstance(s, Sequential) else \
            s.branches if isinstance(s, Parallel) else None
        if not members:
            return None
        ranks = {self.whole_rank(p, parts) for p in members}
        return ranks.pop() if len(ranks) == 1 else None

    def worth_it(self, s: SectionLike) -> bool:
        """More than one node execution per run (a Loop, or two nodes or more), or a node of a
        stateful engine whose work all runs in segments."""
        nodes = section_nodes(s, True)
        return (len(nodes) > 1 or any(self.engine_of[n] in self.shared for n in nodes)
                or _has_loop(s))

    def nested_loop(self, s: SectionLike) -> bool:
        """A fixed Loop inside a loop the parent runs may be a segment (run once per outer
        iteration; its nodes see its own iterations, as in one process) when none of its nodes
        stops loops: a stop of the outer loop would not reach the parent."""
        return (type(s) is Loop and not any(self.stops[n] for n in section_nodes(s, True)))

    def closed(self, s: SectionLike, inside_loop: bool = False) -> bool:
        """Each stream leaving the section can leave through the stand-in: its producer's
        stream ends where the stand-in ends (the innermost loop around the producer lies
        inside the section, or the walk has none, and the section ends with that scope: a
        stream ending earlier in one process would hold its consumer back until the whole
        section ended, as a prefill's stream would wait for the decode loop after it), and
        nothing outside reads its name but its consumer. Each entering it can enter through the
        stand-in: outside any loop (one run of the stand-in reads it whole), its producer and
        consumer in this walk only (the producer's edge goes to the stand-in), its name read
        inside by its consumer alone and taken once."""
        members = set(section_nodes(s, True))
        looped = _looped(s)
        taken: set[str] = set()
        for (p, c), edge in self.streams.items():
            if c in members and p not in members:
                if (inside_loop or edge.name in taken
                        or not self.walks_of.get(p, set()) == self.walks_of.get(c) == {self.walk}
                        or any(edge.name in self.readers[n] for n in members
                               if (n, edge.name) not in self.consumes)):
                    return False
                taken.add(edge.name)
                continue
            if p in members and c not in members and (
                    (p not in looped and p in self.looped) or not _ends_with_scope(s, p)
                    or edge.name in self.persisted
                    or any(edge.name in xs for n, xs in self.readers.items()
                           if n not in members and (p, n) not in self.streams)):
                return False
        return True

    def drop(self, engines: set[str]) -> None:
        """``engines``' nodes keep the per-node path."""
        for e in engines:
            self.eligible -= self.shared.pop(e)

    # ---- rewriting -------------------------------------------------------------------------

    def rewrite_walk(self, root: SectionLike) -> SectionLike:
        """A walk with Parts that runs whole on one worker is one segment: the worker asks the
        model's ``next_part_walk`` (the run's walk keeps the walk's name, so the model finds
        its Parts). Parts anywhere else stay the parent's, with the per-node path inside."""
        if section_nodes(root, True) != section_nodes(root):  # it has Parts
            rank = self.whole_rank(root, parts=True)
            if rank is not None and self.worth_it(root) and self.closed(root):
                made = self.make(root, rank)
                if made is not None:
                    return made
        return self.rewrite(root, inside_loop=False)

    def rewrite(self, s: SectionLike, inside_loop: bool) -> SectionLike:
        if isinstance(s, Part):  # its sub-walks are sections like any (chosen at run time)
            if not isinstance(s.walks, Mapping):
                return s
            return Part(s.name, {k: self.rewrite(w, inside_loop) for k, w in s.walks.items()})
        if not inside_loop or self.nested_loop(s):
            rank = self.whole_rank(s)
            if rank is not None and self.worth_it(s) and self.closed(s, inside_loop):
                made = self.make(s, rank)
                if made is not None:
                    return made
        if isinstance(s, str):
            return s
        if isinstance(s, Loop):
            body = self.rewrite(s.section, True)
            if isinstance(s, DynamicLoop):
                return DynamicLoop(body, s.max_iters, s.name, s.outputs, s.accumulated_outputs)
            return Loop(body, s.max_iters, s.outputs, s.accumulated_outputs)
        if isinstance(s, Parallel):
            return Parallel(*(self.rewrite(b, inside_loop) for b in s.branches))
        if not isinstance(s, Sequential):
            return s
        out: list[SectionLike] = []
        run: list[SectionLike] = []
        run_rank: Optional[int] = None

        def close_run() -> None:
            if not run:
                return
            section = run[0] if len(run) == 1 else Sequential(*run)
            made = (self.make(section, run_rank)  # type: ignore[arg-type]
                    if not inside_loop and self.worth_it(section) and self.closed(section)
                    else None)
            if made is not None:
                out.append(made)
            else:
                out.extend(self.rewrite(p, inside_loop) for p in run)
            run.clear()

        for part in s.parts:
            rank = None if inside_loop else self.whole_rank(part)
            if rank is None or rank != run_rank:
                close_run()
            if rank is None:
                out.append(self.rewrite(part, inside_loop))
                run_rank = None
            else:
                run.append(part)
                run_rank = rank
        close_run()
        return Sequential(*out)

    def make(self, section: SectionLike, rank: int) -> Optional[SectionLike]:
        """The stand-in of ``section`` (recorded as a segment), or None when it cannot stand
        there (streams enter it and it would need a Loop around it)."""
        name = f"segment:{self.walk}:{self.count}"
        inputs: list[str] = []
        made = self.flow(section, set(), inputs)
        members = set(section_nodes(section, True))
        leaving = sorted(((p, c), e) for (p, c), e in self.streams.items()
                         if p in members and c not in members)
        pushes = {e.name for _, e in leaving}
        outputs: list[Any] = [e for _, e in leaving]
        needed = {x for n, xs in self.readers.items() if n not in members for x in xs}
        needed |= self.exported  # a loop around the section may hand it on
        for x in sorted(made):
            if not (x in needed or x in self.persisted) or x in pushes:
                continue
            edges = {GraphEdge("" if e.to in members else e.to, x, e.persist)
                     for n in members for e in self.nodes[n].outputs
                     if isinstance(e, GraphEdge) and e.name == x and e.to != EMIT}
            outputs.extend(sorted(edges, key=lambda e: (e.to, e.persist)) or [x])
        engines = sorted({self.engine_of[n] for n in members} & set(self.shared))
        takes = sorted(((p, e) for (p, c), e in self.streams.items()
                        if c in members and p not in members), key=lambda t: t[1].name)
        # The stand-in sits in a Loop of one iteration, whose outputs are its own: when a name
        # it makes was made before it (a loop may make again what a node before it made, as a
        # backbone refines the encoder's h; a node may not), and when streams leave it (their
        # scope is then the stand-in's run, not a loop around it) -- unless streams enter it:
        # it then sits in no loop (closed()), and in a Loop it would read one window only.
        plain = [o if isinstance(o, str) else o.name for o in outputs
                 if not isinstance(o, StreamingGraphEdge)]
        remade = bool(set(plain) & set().union(*(m for n, m in self.made.items()
                                                 if n not in members)))
        if takes and remade:
            return None
        self.count += 1
        self.segments.append(Segment(name, self.walk, rank, section, tuple(sorted(members)),
                                     tuple(inputs), tuple(outputs), tuple(engines),
                                     tuple(sorted(pushes)), tuple(takes)))
        if (pushes and not takes) or remade:
            return Loop(name, 1, tuple(dict.fromkeys(plain)))
        return name

    def flow(self, s: SectionLike, made: set[str], reads: list[str]) -> set[str]:
        """Names visible after ``s`` given ``made`` before it (as the graph compiler's made_by);
        appends to ``reads`` what it reads from outside."""
        if isinstance(s, str):
            node = self.nodes[s]  # (a stream it consumes comes from inside: closed())
            reads.extend(x for x in node.inputs if x not in made and x not in reads
                         and (s, x) not in self.consumes)
            return made | set(node.output_names)
        if isinstance(s, Sequential):
            for p in s.parts:
                made = self.flow(p, made, reads)
            return made
        if isinstance(s, Parallel):
            after = set(made)
            for b in s.branches:
                after |= self.flow(b, made, reads)
            return after
        if isinstance(s, Part):  # a sub-walk reads what the Part started with or any makes
            reads_of: list[list[str]] = []
            made_of: list[set[str]] = []
            for w in s.walks.values():
                reads_of.append([])
                made_of.append(self.flow(w, made, reads_of[-1]) - made)
            after = set(made).union(*made_of)
            for w in s.walks.values():
                self.flow(w, after, reads)
            # A name a sub-walk reads before making it itself, and no sibling makes, comes
            # from before the Part (a decode loop's first step reads the prefill walk's token).
            for k, read in enumerate(reads_of):
                siblings = set().union(*(m for j, m in enumerate(made_of) if j != k))
                reads.extend(x for x in read if x not in reads and x not in siblings)
            return after
        assert isinstance(s, Loop)
        inside = self.flow(s.section, made, reads) - made
        return made | {x for x in inside if x in self.persisted} | set(s.outputs) | \
            set(s.accumulated_outputs)


def _children(s: SectionLike) -> list[SectionLike]:
    """The sections directly inside ``s`` (a Part's sub-walks included)."""
    if isinstance(s, Part):
        return list(s.walks.values()) if isinstance(s.walks, Mapping) else []
    if isinstance(s, Loop):
        return [s.section]
    return (list(s.parts) if isinstance(s, Sequential)
            else list(s.branches) if isinstance(s, Parallel) else [])


def _exported(s: SectionLike) -> set[str]:
    """The names the Loops of ``s`` hand on after them (outputs, accumulated outputs)."""
    own = set(s.outputs) | set(s.accumulated_outputs) if isinstance(s, Loop) else set()
    return own.union(*(_exported(p) for p in _children(s)))


def _ends_with_scope(s: SectionLike, node: str) -> bool:
    """Whether ``s`` ends when ``node``'s stream does: its scope (the innermost Loop around it
    in ``s``, or the node itself) is ``s`` or the last part of ``s``'s trailing Sequentials."""
    scope = _innermost_loop(s, node)
    while isinstance(s, Sequential) and s.parts:
        s = s.parts[-1]
    return s == node if scope is None else s is scope


def _innermost_loop(s: SectionLike, node: str) -> Optional[Loop]:
    """The innermost Loop of ``s`` around ``node``, if any."""
    for child in _children(s):
        if node in section_nodes(child, True):
            inner = _innermost_loop(child, node)
            return inner if inner is not None else (s if isinstance(s, Loop) else None)
    return None


def _looped(s: SectionLike) -> set[str]:
    """The nodes inside a Loop of ``s``."""
    if isinstance(s, Loop):
        return set(section_nodes(s, True))
    return set().union(*(_looped(p) for p in _children(s)))


def _has_loop(s: SectionLike) -> bool:
    return isinstance(s, Loop) or any(_has_loop(p) for p in _children(s))


def loop_names(s: SectionLike) -> set[str]:
    """The names of the DynamicLoops in ``s`` (a Part's sub-walks included)."""
    own = {s.name} if isinstance(s, DynamicLoop) else set()
    return own.union(*(loop_names(p) for p in _children(s)))


def section_nodes(s: SectionLike, parts: bool = False) -> list[str]:
    """The nodes a walk section runs, in order; a Part's sub-walks are chosen per request, so
    their nodes count only with ``parts``."""
    if isinstance(s, str):
        return [s]
    if isinstance(s, Part):
        return [n for w in s.walks.values() for n in section_nodes(w, True)] if parts else []
    if isinstance(s, Sequential):
        return [n for p in s.parts for n in section_nodes(p, parts)]
    if isinstance(s, Parallel):
        return [n for b in s.branches for n in section_nodes(b, parts)]
    if isinstance(s, Loop):
        return section_nodes(s.section, parts)
    return []


__all__ = ["SEGMENT_ENGINE", "Segment", "SegmentPlan", "find_segments",
           "loop_names", "stand_in_nodes"]
