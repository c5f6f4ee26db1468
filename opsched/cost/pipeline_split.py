"""How the layers are split into pipeline chunks: even, uneven first and last ranks, or a layout string.

A split is a tuple of chunk strings in chunk order (chunk ``c = virtual index x pp + rank``, on pipeline rank
``c mod pp``), one letter per unit, Megatron-Core's letters (``--pipeline-model-parallel-layout``,
``megatron/core/transformer/pipeline_parallel_layer_layout.py``): ``E`` the embedding, ``t`` a decoder layer,
``m`` a multi-token-prediction (MTP) layer, ``L`` the final norm, head and loss. Megatron-Core offers three ways
to say it, and :func:`chunk_units` reads each:

* even (the default): ``layers / (pp x vpp)`` layers per chunk; with ``ends_as_layers`` the embedding and the
  loss count as one layer each (``--account-for-embedding-in-pipeline-split``, ``--account-for-loss-in-pipeline-split``);
* first and last pipeline ranks with their own layer counts (``--decoder-first-pipeline-num-layers``,
  ``--decoder-last-pipeline-num-layers``), each a multiple of vpp, the other ranks sharing the rest evenly;
* a layout string (``--pipeline-model-parallel-layout``): ``|`` ends a chunk, ``(...)*n`` repeats a group,
  ``x*n`` a letter, commas and spaces are cosmetic. Megatron-Bridge's DeepSeek-V3 recipe writes
  ``Et|(tt|)*30mL``: 32 chunks, the embedding and one layer first, two layers in each of the next 30, the MTP
  layer and the loss last.

Megatron puts the MTP layers on the last chunk when no layout string places them.

>>> expand_pipeline_layout("Et|(tt|)*2mL")
('Et', 'tt', 'tt', 'mL')
>>> chunk_units(layers=4, mtp_layers=0, pp=2, vpp=1, first_layers=1, last_layers=3)
('Et', 'tttL')
>>> compact_pipeline_layout(expand_pipeline_layout("Et|(tt|)*30mL"))
'Et|(tt|)*30mL'
"""

from __future__ import annotations

import re

from opsched.errors import OpschedError

#: the letters of a layout string and what each unit is
UNIT_LETTERS = {"E": "embedding", "t": "decoder layer", "m": "MTP layer", "L": "loss (final norm and head)"}

_REPEAT = re.compile(r"\*(\d+)")


def expand_pipeline_layout(text: str) -> tuple[str, ...]:
    """The chunks a layout string names (see the module docstring); groups may nest, ``((t|)*2E)*3``.

    Refuses a malformed string in one line (:class:`OpschedError`).

    >>> expand_pipeline_layout("E,t*3|((t|)*2)*2,L")
    ('Ettt', 't', 't', 't', 't', 'L')
    """
    cleaned = re.sub(r"[,\s]", "", text)
    if not cleaned:
        raise OpschedError("pipeline_layout is empty: write its chunks, e.g. pipeline_layout=Et|(tt|)*30mL")
    flat, end = _expand(cleaned, 0, text)
    if end != len(cleaned):
        raise OpschedError(f"pipeline_layout={text!r}: ')' at character {end + 1} closes no '('")
    return tuple(flat.split("|"))


def _expand(s: str, i: int, text: str) -> tuple[str, int]:
    """Expand ``s`` from ``i`` up to an unmatched ``)`` or the end: (the letters and bars, where it stopped)."""
    out: list[str] = []
    while i < len(s) and s[i] != ")":
        if s[i] == "(":
            inner, j = _expand(s, i + 1, text)
            if j >= len(s):
                raise OpschedError(f"pipeline_layout={text!r}: '(' without its ')'")
            piece, i = inner, j + 1
        elif s[i] in UNIT_LETTERS or s[i] == "|":
            piece, i = s[i], i + 1
        else:
            raise OpschedError(f"pipeline_layout={text!r}: {s[i]!r} is no layout letter; use E (embedding), "
                               "t (decoder layer), m (MTP layer), L (loss), | (chunk end), (...)*n (repeat)")
        repeat = _REPEAT.match(s, i)
        if repeat:
            piece, i = piece * int(repeat.group(1)), repeat.end()
        elif i < len(s) and s[i] == "*":
            raise OpschedError(f"pipeline_layout={text!r}: '*' needs a whole number after it")
        out.append(piece)
    return "".join(out), i


def compact_pipeline_layout(chunks: tuple[str, ...] | list[str]) -> str:
    """The layout string Megatron-Core reads for ``chunks``: runs of equal chunks as ``(..|)*n``, runs of a letter
    as ``x*n`` (Megatron's parser takes one level of parentheses, so none nest).

    >>> compact_pipeline_layout(("Ettt", "tttt", "tttt", "tttL"))
    'Et*3|(t*4|)*2t*3L'
    """
    def letters(chunk: str) -> str:
        return "".join(f"{m.group(1)}*{len(m.group(0))}" if len(m.group(0)) > 2 else m.group(0)
                       for m in re.finditer(r"(.)\1*", chunk))

    parts: list[str] = []
    k = 0
    while k < len(chunks):
        n = 1
        while k + n < len(chunks) - 1 and chunks[k + n] == chunks[k]:  # the last chunk closes the string
            n += 1
        if n > 1:
            parts.append(f"({letters(chunks[k])}|)*{n}")
        else:
            parts.append(letters(chunks[k]) + ("|" if k + 1 < len(chunks) else ""))
        k += n
    return "".join(parts)


def chunk_units(*, layers: int, mtp_layers: int, pp: int, vpp: int, ends_as_layers: bool = False,
                first_layers: int = 0, last_layers: int = 0, pipeline_layout: str = "") -> tuple[str, ...]:
    """The split of ``layers`` decoder layers and ``mtp_layers`` MTP layers into ``pp x vpp`` chunks.

    Refuses, in one line naming the fixes that work (:func:`split_fixes`), a split Megatron would refuse.
    """
    chunks = pp * vpp
    if pipeline_layout:
        units = expand_pipeline_layout(pipeline_layout)
        _check_layout_string(units, layers, mtp_layers, pp, vpp)
        return units
    if first_layers or last_layers:
        counts = _first_last_counts(layers, pp, vpp, first_layers, last_layers, mtp_layers)
    else:
        total = layers + 2 * ends_as_layers
        per = total // chunks
        if total % chunks or per <= ends_as_layers:
            counted = f"{layers} layers + embedding + head" if ends_as_layers else f"{layers} layers"
            raise OpschedError(f"pp x vpp = {pp} x {vpp} does not divide the {counted} into chunks of whole "
                               f"layers; {split_fixes(layers, mtp_layers, pp, vpp, ends_as_layers)}")
        counts = [per - ends_as_layers * (c in (0, chunks - 1)) for c in range(chunks)]
        if chunks == 1:
            counts = [layers]
    units = ["t" * n for n in counts]
    units[0] = "E" + units[0]
    units[-1] = units[-1] + "m" * mtp_layers + "L"
    return tuple(units)


def _first_last_counts(layers: int, pp: int, vpp: int, first: int, last: int, mtp_layers: int) -> list[int]:
    """Layers per chunk with ``first`` layers on pipeline rank 0 and ``last`` on the last rank (0: as the others),
    each rank's layers split evenly over its vpp chunks: Megatron-Core's rule (TransformerConfig)."""
    fixes = lambda: split_fixes(layers, mtp_layers, pp, vpp)  # noqa: E731
    if pp < 2:
        raise OpschedError("first_layers / last_layers need pp >= 2: they set the first and the last pipeline rank")
    for name, n in (("first_layers", first), ("last_layers", last)):
        if n % vpp:
            raise OpschedError(f"{name}={n} is no multiple of vpp={vpp}: each of the rank's chunks takes whole "
                               f"layers; {fixes()}")
    middle_ranks = pp - bool(first) - bool(last)
    rest = layers - first - last
    if rest < 0 or (middle_ranks == 0) != (rest == 0) or (middle_ranks and rest % (middle_ranks * vpp)):
        raise OpschedError(f"first_layers={first}, last_layers={last}: the other {layers - first - last} of the "
                           f"{layers} layers do not split evenly over the {middle_ranks} other pipeline ranks x "
                           f"vpp {vpp}; {fixes()}")
    per_rank = [rest // middle_ranks if middle_ranks else 0] * pp
    if first:
        per_rank[0] = first
    if last:
        per_rank[-1] = last
    return [per_rank[c % pp] // vpp for c in range(pp * vpp)]


def _check_layout_string(units: tuple[str, ...], layers: int, mtp_layers: int, pp: int, vpp: int) -> None:
    """Megatron-Core's checks on a layout string (``validate_layer_layout``), each refused in one line."""
    text = compact_pipeline_layout(units)
    flat = "".join(units)
    if len(units) != pp * vpp:
        raise OpschedError(f"pipeline_layout {text} has {len(units)} chunks, not pp x vpp = {pp} x {vpp}; "
                           f"set pp and vpp so that pp x vpp = {len(units)}")
    if flat.count("E") != 1 or flat.count("L") != 1 or not flat.startswith("E") or not flat.endswith("L"):
        raise OpschedError(f"pipeline_layout {text} must begin with the embedding E and end with the loss L, "
                           "each once")
    if flat.count("t") != layers:
        raise OpschedError(f"pipeline_layout {text} places {flat.count('t')} decoder layers (t), the model has "
                           f"{layers}; {split_fixes(layers, mtp_layers, pp, vpp)}")
    if flat.count("m") != mtp_layers:
        raise OpschedError(f"pipeline_layout {text} places {flat.count('m')} MTP layers (m), the model has "
                           f"{mtp_layers}; {split_fixes(layers, mtp_layers, pp, vpp)}")
    if "m" in flat and "t" in flat[flat.index("m"):]:
        raise OpschedError(f"pipeline_layout {text} places a decoder layer after an MTP layer; MTP layers come last")
    if any(not chunk for chunk in units):
        raise OpschedError(f"pipeline_layout {text} has an empty chunk; give every chunk at least one unit")


def balanced_layout(layers: int, mtp_layers: int, chunks: int) -> tuple[str, ...] | None:
    """A layout string's chunks that spread the embedding, layers, MTP layers and loss, one unit each, as evenly
    as whole units allow, the first and last chunks taking the fewest (None when there are fewer units than chunks).

    >>> compact_pipeline_layout(balanced_layout(61, 1, 32))
    'Et|(tt|)*30mL'
    """
    units = "E" + "t" * layers + "m" * mtp_layers + "L"
    if len(units) < chunks:
        return None
    base, extra = divmod(len(units), chunks)
    # the extra units go to the middle chunks first (the ends hold the embedding and the head besides)
    order = list(range(1, chunks - 1)) + [c for c in (0, chunks - 1) if c not in range(1, chunks - 1)]
    sizes = [base] * chunks
    for c in order[:extra]:
        sizes[c] += 1
    out, k = [], 0
    for n in sizes:
        out.append(units[k:k + n])
        k += n
    return tuple(out)


def work_balanced_layout(units: str, work: list[float], chunks: int) -> tuple[str, ...] | None:
    """``units`` (a layout string's letters in model order, ``E`` first and ``L`` last, one a unit, ``work[i]``
    the work of unit ``i``) cut into ``chunks`` runs of at least one unit each, the cut after run ``c`` at the
    unit boundary nearest to ``(c + 1) / chunks`` of the total work: the split for a model whose layers differ
    in work (a vision encoder's layers beside a language model's, split as one run of layers), where
    :func:`balanced_layout`'s equal counts leave the chunks of light layers idle. Rounding each cut to the nearest
    boundary, not packing runs up to a bound, spreads the runs a unit heavier than the rest along the pipeline
    (an interleaved rank holds every pp-th chunk). None when there are fewer units than chunks.

    >>> work_balanced_layout("E" + "t" * 6 + "L", [0.0, 1, 1, 1, 1, 3, 3, 0.5], 3)
    ('Ettt', 'tt', 'tL')
    >>> work_balanced_layout("E" + "t" * 8 + "L", [0.0] + [0.1] * 4 + [1.0] * 4 + [0.0], 4)  # light layers first
    ('Ettttt', 't', 't', 'tL')
    >>> work_balanced_layout("EtL", [1.0, 1.0, 1.0], 4) is None
    True
    """
    n = len(units)
    if n < chunks or len(work) != n:
        return None
    total = sum(work)
    prefix = [0.0]
    for w in work:
        prefix.append(prefix[-1] + w)
    cuts, k = [0], 0
    for c in range(1, chunks):
        target = c * total / chunks
        lowest, highest = cuts[-1] + 1, n - (chunks - c)  # a unit for this run and for each run after it
        k = min(range(lowest, highest + 1), key=lambda j: (abs(prefix[j] - target), j))
        cuts.append(k)
    cuts.append(n)
    return tuple(units[a:b] for a, b in zip(cuts, cuts[1:]))


def split_fixes(layers: int, mtp_layers: int, pp: int, vpp: int, ends_as_layers: bool = False) -> str:
    """What would split ``layers`` (and ``mtp_layers``) into ``pp x vpp`` chunks Megatron takes, as one clause.

    >>> split_fixes(61, 0, 16, 1)  # doctest: +NORMALIZE_WHITESPACE
    'fixes: first_layers=2,last_layers=3 (4 layers on each rank between), or
    pipeline_layout=Et*3|(t*4|)*14ttL, or pp x vpp dividing 61 (1, 61) or, with ends_as_layers=1, 63 (3, 7, 9, 21)'
    """
    chunks = pp * vpp
    fixes = []
    total = layers + 2
    if ends_as_layers and layers % chunks == 0:
        fixes.append("ends_as_layers=0")
    elif not ends_as_layers and total % chunks == 0 and total // chunks > 1:
        fixes.append("ends_as_layers=1")
    first_last = _first_last_fix(layers, pp, vpp)
    if first_last:
        fixes.append(first_last)
    layout = balanced_layout(layers, mtp_layers, chunks)
    if layout and all(layout):
        fixes.append(f"pipeline_layout={compact_pipeline_layout(layout)}")
    even = [d for d in range(1, layers + 1) if layers % d == 0]
    ends = [d for d in range(2, total) if total % d == 0 and total // d > 1]
    fixes.append(f"pp x vpp dividing {layers} ({', '.join(map(str, even))}) or, with ends_as_layers=1, "
                 f"{total} ({', '.join(map(str, ends))})")
    return "fixes: " + ", or ".join(fixes)


def _first_last_fix(layers: int, pp: int, vpp: int) -> str | None:
    """``first_layers=..,last_layers=..`` that splits the layers with the middle ranks as full as possible and the
    first and last ranks no fuller than them (None when none does)."""
    middle = pp - 2
    if middle < 0:
        return None
    for per in range(-(-layers // pp), 0, -1):  # the middle ranks' layers, from the even share down
        if middle and per % vpp:
            continue
        rest = layers - middle * per
        if rest < 2 * vpp or rest > 2 * per:
            continue
        first = (rest // 2) // vpp * vpp
        first = min(first, rest - vpp) if rest - first > per else first
        last = rest - first
        if first >= vpp and last >= vpp and last % vpp == 0 and first <= per and last <= per:
            others = f" ({per} layers on each rank between)" if middle else ""
            return f"first_layers={first},last_layers={last}{others}"
    return None
