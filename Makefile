# Conveniences over setup.sh (which needs nothing but bash on a fresh machine).
.PHONY: setup demo test clean bench
setup:
	bash setup.sh setup
demo:
	bash setup.sh demo
test:
	bash setup.sh test
clean:
	.venv/bin/testbed clean
bench:
	.venv/bin/python experiments/bench_wan.py
