"""Print backend=None's ratio to the best peer per cell of a GPU bench JSON (issue [8]'s bar and FA4's).

    python tools/gpu/ratio_summary.py results/.../bench_workloads.json [impl]
"""
import json
import sys

doc = json.load(open(sys.argv[1]))
impl = sys.argv[2] if len(sys.argv) > 2 else "flashport"
env = doc["environment"]
print(f"{doc['suite']} on {env.get('card')} (peers {env.get('peer_versions')}), impl {impl}")
for e in doc["results"]:
    if e["impl"] != impl:
        continue
    if e["status"] != "ok":
        print(f"  {e['label']:<52} {e['mode']}  {e['status']}: {e.get('error', '')[:80]}")
        continue
    frac = e.get("graph_frac_of_copy") or e.get("frac_of_copy")
    tail = (f"vs best {e.get('vs_best_peer') or 0:.2f} ({e.get('best_peer')})  bar {e.get('vs_best_bar_peer') or 0:.2f}"
            if e.get("vs_best_peer") else f"copy {frac or 0:.0%}")
    print(f"  {e['label']:<52} {e['mode']}  {e['ms']:8.3f} ms  {tail}")
