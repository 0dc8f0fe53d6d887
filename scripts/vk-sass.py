#!/usr/bin/env python3
"""Disassembles the machine code of NVIDIA Vulkan pipelines.

Usage: vk-sass.py BLOB_DIR OUT_DIR [NVDISASM]. Each BLOB_DIR/<kernel>.bin is one pipeline alone in
a fresh pipeline cache (written with MAMBA_VK_PIPELINE_BINARY_DIR set). NVIDIA's cache data is a
small header and a zstd frame; inside it (an "NVDANVVM" container) the SASS is stored raw. The
code starts at its first instruction (the S2R or LDC that every kernel begins with, found by
trying each 8-byte-aligned start) and ends where nvdisasm first finds no valid instruction; the
script disassembles it with `nvdisasm -b SM90` (raw input). nvdisasm comes with the CUDA toolkit
or with the PyPI triton wheel (triton/backends/nvidia/bin). Needs the `zstandard` module.
"""
import os, re, subprocess, sys, tempfile
import zstandard

def nvdisasm(tool, code):
    with tempfile.NamedTemporaryFile(suffix='.bin', delete=False) as f:
        f.write(code)
        name = f.name
    try:
        r = subprocess.run([tool, '-b', 'SM90', name], capture_output=True, text=True, timeout=120)
        return r.stdout, r.stderr
    finally:
        os.unlink(name)

def machine_code(blob):
    start = blob.find(b'\x28\xb5\x2f\xfd')
    if start < 0:
        raise ValueError('no zstd frame')
    return zstandard.ZstdDecompressor().decompressobj().decompress(blob[start:])

def main():
    blob_dir, out_dir = sys.argv[1], sys.argv[2]
    tool = sys.argv[3] if len(sys.argv) > 3 else 'nvdisasm'
    os.makedirs(out_dir, exist_ok=True)
    for name in sorted(os.listdir(blob_dir)):
        if not name.endswith('.bin'):
            continue
        raw = machine_code(open(os.path.join(blob_dir, name), 'rb').read())
        best = None
        # The code is a run of valid instructions; take the longest clean disassembly.
        for start in range(0, min(len(raw), 4096), 8):
            text, errors = nvdisasm(tool, raw[start:start + 16 * 64])
            if errors or not text:
                continue
            if 'S2R' in text[:400] or 'LDC' in text[:400] or 'MOV' in text[:400]:
                best = start
                break
        if best is None:
            print(f'{name}: no code found')
            continue
        # The code ends where nvdisasm first finds no valid instruction.
        text, errors = nvdisasm(tool, raw[best:best + (len(raw) - best) // 16 * 16])
        found = re.search(r'at address 0x([0-9a-fA-F]+)', errors)
        length = int(found.group(1), 16) if found else (len(raw) - best) // 16 * 16
        text, _ = nvdisasm(tool, raw[best:best + length])
        lo = best + length
        with open(os.path.join(out_dir, name[:-4] + '.sass'), 'w') as f:
            f.write(f'// {name}: code at {best}, {lo - best} bytes\n' + text)
        print(f'{name}: {lo - best} bytes of code')

if __name__ == '__main__':
    main()
