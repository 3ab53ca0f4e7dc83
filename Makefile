# Two commands do everything on a fresh machine with Python 3.11+: `make run` and `make test`.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
RUN_STAMP := $(VENV)/.installed-run

.PHONY: install lock messages alerts-test run flower test test-fast test-api test-pip test-browser screenshots lint format bench bench-pg bench-fleet bench-admin bench-eta clean

# Installs come from the lock files (requirements/lock*.txt, written by `make lock` from the
# human lists requirements*.txt): every package, transitive ones too, pinned with its hashes.
# What `make run` needs: the runtime requirements plus the embedded servers (requirements-run.txt).
# Then the device agent library from this checkout (iotqueue-device/, editable: devtools'
# simulator and demo devices import it): a directory has no hash to lock, so it comes after the
# locked tree, without dependencies (its one, paho-mqtt, is in the lock).
$(RUN_STAMP): requirements/lock-run.txt iotqueue-device/pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet --require-hashes -r requirements/lock-run.txt
	$(BIN)/python -m pip install --quiet --no-deps -e ./iotqueue-device
	touch $(RUN_STAMP)

# Everything development needs (tests, linters): the same plus requirements-dev.txt. A venv
# made by `make run` is completed here by the first `make test` or `make install`.
$(STAMP): $(RUN_STAMP) requirements/lock-dev.txt
	$(BIN)/python -m pip install --quiet --require-hashes -r requirements/lock-dev.txt
	touch $(STAMP)

## Re-resolve the lock files after editing a human list (requirements*.txt), with pip-tools in
## a virtualenv of its own: the development tree first, then the `make run` and image trees
## within it, so the three agree, and Flower's (`make flower`) at the development tree's
## versions. A pin the lists leave open stays as locked until asked:
## `make lock LOCK_ARGS="--upgrade-package kombu"` (or "--upgrade" for all of them).
LOCK_VENV := $(VENV)/lock-tools
PIP_COMPILE = $(LOCK_VENV)/bin/pip-compile --quiet --generate-hashes --allow-unsafe --strip-extras \
	--no-emit-index-url --no-emit-find-links

lock:
	test -x $(LOCK_VENV)/bin/pip-compile || { $(PYTHON) -m venv $(LOCK_VENV) \
		&& $(LOCK_VENV)/bin/python -m pip install --quiet pip-tools==7.6.2; }
	$(PIP_COMPILE) $(LOCK_ARGS) --output-file requirements/lock-dev.txt requirements-dev.txt
	rm -f requirements/lock-run.txt requirements/lock.txt requirements/lock-flower.txt
	$(PIP_COMPILE) -c requirements/lock-dev.txt --output-file requirements/lock-run.txt requirements-run.txt
	$(PIP_COMPILE) -c requirements/lock-run.txt --output-file requirements/lock.txt requirements.txt
	$(PIP_COMPILE) -c requirements/lock-dev.txt --output-file requirements/lock-flower.txt requirements-flower.txt

# The translation catalogues, compiled from the committed .po files (iotqueue/catalogue.py).
CATALOGUES := $(patsubst %.po,%.mo,$(wildcard locale/*/LC_MESSAGES/*.po))

$(CATALOGUES): %.mo: %.po $(RUN_STAMP)
	$(BIN)/python -m iotqueue.catalogue compile

install: $(STAMP) $(CATALOGUES)

## Start Redis, an MQTT broker, worker, beat, bridge, web and simulated devices; run the demo.
## Installs only what running needs (no test tools): `make test` adds those.
run: $(RUN_STAMP) $(CATALOGUES)
	$(BIN)/python -m devtools.devstack

## Flower, Celery's web monitor, on http://127.0.0.1:5555 against REDIS_URL's broker (with
## `make run`, paste its `export` line first). Optional: installs requirements/lock-flower.txt.
## Its task list shows args and kwargs, where engine tasks name their runs (the browser tier
## starts Flower with this line's options).
flower: install
	$(BIN)/python -m pip install --quiet --require-hashes -r requirements/lock-flower.txt
	$(BIN)/celery -A iotqueue flower --address=127.0.0.1 --port=5555 \
		--tasks_columns=name,uuid,state,args,kwargs,received,runtime,worker

## The whole suite against real servers (embedded ones unless REDIS_URL / MQTT_URL are set);
## first installs GNU gettext and promtool when missing (as root): the catalogue test extracts
## with xgettext, the alert rules' test runs promtool.
## The tests are spread over TEST_WORKERS processes (pytest-xdist), each starting a stack of its
## own (tests/conftest.py). Most of a stack test is waiting on the worker, the bridge or a device,
## so two of them share two cores well and the suite takes about half as long. worksteal: each
## process takes half the tests in order and an idle one takes over the other's remaining tail.
## (Not loadfile: it keys tests by node id, and schemathesis gives all the operations of
## tests/iotqueue/test_api_schema_fuzz.py one id, so all but one of them would silently not
## run.) TEST_WORKERS=0 runs the suite in this one process.
TEST_WORKERS ?= 2

test: install
	$(BIN)/python -m devtools.messages install
	$(BIN)/python -m devtools.promtool install
	$(BIN)/python -m pytest -n $(TEST_WORKERS) --dist worksteal

## The unit tier alone (tests/unit/): logic module by module, no server started or reached.
test-fast: install
	$(BIN)/python -m devtools.messages install
	$(BIN)/python -m devtools.promtool install
	$(BIN)/python -m pytest -m "not stack" tests/unit

## The API against its own schema, widely: schemathesis with every check and the examples,
## coverage, fuzzing and stateful phases, on DATABASE_URL's database when set (a few minutes).
## The seed is printed first; SCHEMATHESIS_SEED=<seed> replays that run.
test-api: install
	IOTQUEUE_API_CONTRACT=1 $(BIN)/python -m pytest -s tests/iotqueue/test_api_contract.py

## The browser tier (tests/browser/): the admin in headless Chromium through Selenium, on a live
## server beside the real worker and bridge, and Flower's task list (so it installs
## requirements/lock-flower.txt); installs Debian's chromium, chromium-driver and a Chinese
## font first when missing (as root). A failed test's screenshot path is in its report.
test-browser: install
	$(BIN)/python -m devtools.browser install
	$(BIN)/python -m pip install --quiet --require-hashes -r requirements/lock-flower.txt
	$(BIN)/python -m pytest -m browser tests/browser

## Regenerate docs/img/ (dashboard and run page, English and Chinese) on a throwaway stack.
screenshots: install
	$(BIN)/python -m devtools.browser install
	$(BIN)/python docs/screenshot.py

## End-to-end tests with the pip-installed servers only (what a laptop without them gets).
test-pip: install
	IOTQUEUE_EMBEDDED=pip $(BIN)/python -m pytest tests/jobs/test_end_to_end.py tests/devtools/test_servers.py

lint: install
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

format: install
	$(BIN)/ruff check --fix .
	$(BIN)/ruff format .

## Benchmark on SQLite; `make bench DATABASE_URL=postgres://...` runs it on that server instead
## (a scratch database is created there). Only a DATABASE_URL given on make's command line counts:
## one exported for the dev stack is not the bench's business.
BENCH_DATABASE_URL ?= postgres://postgres@127.0.0.1:5432/postgres
BENCH_DATABASE_ARG = $(if $(filter command line,$(origin DATABASE_URL)),--database-url '$(DATABASE_URL)')

bench: install
	$(BIN)/python -m bench $(BENCH_DATABASE_ARG)

## The same phases on PostgreSQL (BENCH_DATABASE_URL, default the local server).
bench-pg: install
	$(BIN)/python -m bench --database-url '$(BENCH_DATABASE_URL)'

## One fan-out step over 10,000 simulated devices with 2 bridges in a shared group and 2 workers,
## on PostgreSQL (BENCH_DATABASE_URL), then again with a bridge SIGKILLed half-way
## (bench/README.md). BENCH_FLEET_ARGS="--devices 200" for a quick look.
bench-fleet: install
	$(BIN)/python -m bench.fleet --database-url '$(BENCH_DATABASE_URL)' $(BENCH_FLEET_ARGS)

## The dashboard, the run list and the device list timed at 10,000 devices and 1,000,000 step
## rows, in a scratch database on BENCH_DATABASE_URL's PostgreSQL (bench/README.md).
## BENCH_ADMIN_ARGS="--rows 20000" for a quick look.
bench-admin: install
	$(BIN)/python -m bench.admin_lists --server '$(BENCH_DATABASE_URL)' $(BENCH_ADMIN_ARGS)

## The preview's estimated finish against the measured one: a 500-device fan-out ramped from
## 120 to 1,200 a minute, 2 s commands, on SQLite (bench/README.md; ~2 min here).
## BENCH_ETA_ARGS="--devices 100" for a quick look.
bench-eta: install
	$(BIN)/python -m bench.preview_eta $(BENCH_ETA_ARGS)

## Update locale/*/LC_MESSAGES/django.po from the code (installs GNU gettext as root if missing);
## then translate the new messages in the .po and `make install` compiles them.
messages: install
	$(BIN)/python -m devtools.messages
	$(BIN)/python -m iotqueue.catalogue check || true

## Check deploy/prometheus/alerts.yml and run its tests with promtool (installs Debian's
## prometheus package as root if promtool is missing).
alerts-test: install
	$(BIN)/python -m devtools.promtool

clean:
	rm -rf $(VENV) var .pytest_cache .ruff_cache
