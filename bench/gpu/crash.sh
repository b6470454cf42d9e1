source bench/gpu/setup.sh; timeout 140 python3 bench/gpu/crash.py 2>&1 | grep -v "^wrote" | tail -80
