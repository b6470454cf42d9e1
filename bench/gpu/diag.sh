source bench/gpu/setup.sh
timeout 400 python3 bench/gpu/diagnose.py 2>&1 | grep -v "^I1\|^W1" | tail -40
