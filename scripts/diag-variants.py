#!/usr/bin/env python3
"""Diagnostic variants of the Mamba-3 SISO SIMT kernels (docs/PERFORMANCE.md, run 24).

Each variant removes one part of the kernels, so its results are wrong: it only bounds what a
change to that part could gain. Run in a scratch checkout (a git worktree), never on main:

    scripts/diag-variants.py VARIANT[+VARIANT...]   edits the shaders in place

then commit the edit on a scratch branch and time it with scripts/build-variants.sh and
scripts/time-variants.sh. Variants:
  q4       the 4x4 product step (mma4) does a quarter of its FMAs, every shared read kept
  none     mma4 does one FMA: the products and most of their shared reads are gone
  nobar    no workgroup barriers in the chunk, dqk and state kernels
  nost     the chunk states (S_in, dS_out) are read from one 256-byte spot (cache hits)
  norot    the rotation table likewise
  noglobal every staged tensor of the chunk and dqk kernels likewise
  nowalkstore the regular state walks skip their per-chunk state stores (a branch never taken)
"""
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
KERNELS = [ROOT / 'shaders/kernels' / f'mamba3_siso_{k}.slang' for k in ('chunk', 'dqk', 'state')]
TILE = ROOT / 'shaders/common/siso_tile.slang'
# keeps each load's alignment (4, 2, 1 floats) and confines it to 64 floats
MASKS = {'load_f32x4': '60u & ', 'load_f32x2': '62u & ', 'load_f32': '63u & ', 'load_row4': '0u & '}
TENSORS = {
    'nost': r'staged\.(?:states|dstates)',
    'norot': r'staged\.rotation|rotation',
    'noglobal': r'staged\.\w+|present_or\([^()]*\)|\(GATED != 0 \? staged\.dout : staged\.v\)',
}
MMA4_BODY = """    acc[0] += a.x * b;
    acc[1] += a.y * b;
    acc[2] += a.z * b;
    acc[3] += a.w * b;
}"""


def edit(path, change):
    text = path.read_text()
    new, count = change(text)
    path.write_text(new)
    return count


def product_step(body):
    def change(text):
        if MMA4_BODY not in text:
            sys.exit('diag-variants: mma4 is not the shipped 4x4 step (variant applied twice?)')
        return text.replace(MMA4_BODY, body + '\n}'), 1
    return edit(TILE, change)


def confine(variant):
    pattern = re.compile(r'\b(load_f32x4|load_f32x2|load_f32|load_row4)\((' + TENSORS[variant] + r'), ')
    # dqk's general-path state rows come in through a parameter named `states`
    extra = variant == 'nost'
    count = 0
    for path in KERNELS + [TILE]:
        def change(text):
            text, n = pattern.subn(lambda m: f'{m.group(1)}({m.group(2)}, {MASKS[m.group(1)]}', text)
            if extra:
                text, n2 = re.subn(r'load_row4\(states, state_base \+ \(p0 \+ pp\) \* push\.state,',
                                   'load_row4(states, 0u,', text)
                n += n2
            return text, n
        count += edit(path, change)
    return count


def remove_barriers(path):
    barrier = 'GroupMemoryBarrierWithGroupSync();'
    return edit(path, lambda text: (text.replace(barrier, '/* DIAGNOSTIC nobar */;'), text.count(barrier)))


def skip_walk_stores():
    path = ROOT / 'shaders/kernels/mamba3_siso_state.slang'
    call = '        store_state_block(t, states, (t.bh * push.chunks + c) * matrix, acc0, acc1);'
    guarded = '        if (push.chunks > 0x7fffffffu) /* DIAGNOSTIC nowalkstore */\n' + call.replace('        ', '            ', 1)
    return edit(path, lambda text: (text.replace(call, guarded), text.count(call)))


def main():
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    for variant in sys.argv[1].split('+'):
        if variant == 'q4':
            n = product_step('    // DIAGNOSTIC q4: a quarter of the FMAs\n    acc[0] += a.x * b;')
        elif variant == 'none':
            n = product_step('    // DIAGNOSTIC none: one FMA\n    acc[0].x += a.x * b.x;')
        elif variant == 'nobar':
            n = sum(remove_barriers(path) for path in KERNELS)
        elif variant == 'nowalkstore':
            n = skip_walk_stores()
        elif variant in TENSORS:
            n = confine(variant)
        else:
            sys.exit(f'diag-variants: unknown variant {variant!r}\n{__doc__}')
        print(f'{variant}: {n} edits')


if __name__ == '__main__':
    main()
