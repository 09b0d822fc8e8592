"""Loops of a SASS dump (a backward branch and its target) and what each holds: HGMMA, F2FP, local loads and
stores (spill traffic), byte-wise shared loads, shared loads / stores and the converter round's ordering ops
(MEMBAR, FENCE, BAR, SYNCS: mbarrier waits and arrives). Used for design.md's SASS facts: `python sass_loops.py
k.sass`."""
import collections
import re
import sys


def loops(sass: str) -> list[dict]:
    ins = []   # (address, op, branch target or None)
    for m in re.finditer(r"/\*([0-9a-f]{4,})\*/\s+(@!?U?P\w+\s+)?([A-Z0-9_.]+)([^;]*);", sass):
        addr, op, rest = int(m.group(1), 16), m.group(3), m.group(4)
        tgt = None
        if op == "BRA":
            t = re.search(r"0x([0-9a-f]+)", rest)
            tgt = int(t.group(1), 16) if t else None
        ins.append((addr, op, tgt))
    out = []
    for addr, op, tgt in ins:
        if tgt is not None and tgt < addr and addr - tgt > 0x100:   # skip the tiny wait-retry loops
            body = [o for a, o, _ in ins if tgt <= a <= addr]
            if any(o.startswith("USETMAXREG") for o in body):   # a wait-retry stub's jump back: not a loop
                continue
            c = collections.Counter(o.split(".")[0] for o in body)
            out.append({"from": hex(tgt), "to": hex(addr), "ops": len(body), "HGMMA": c["HGMMA"],
                        "F2FP_E4M3": sum(o.startswith("F2FP.F16.E4M3") for o in body),
                        "LDL": c["LDL"], "STL": c["STL"], "LDS.U8": sum(o.startswith("LDS.U8") for o in body),
                        "UTMALDG": c["UTMALDG"], "MUFU": c["MUFU"], "MEMBAR": c["MEMBAR"], "FENCE": c["FENCE"],
                        "BAR": c["BAR"], "SYNCS": c["SYNCS"], "LDS": c["LDS"], "STS": c["STS"]})
    return out


if __name__ == "__main__":
    for lp in loops(open(sys.argv[1]).read()):
        print(lp)
