// Package e2e holds Baton's whole-system tests: every part runs as a real process, and faults
// are injected from outside, as they happen in production.
//
// # The chaos run
//
//	go test ./e2e -run Chaos -v                       # about 5 minutes (both runs)
//	go test ./e2e -run Chaos -v -chaos.duration=10m   # longer
//	go test ./e2e -run Chaos -v -chaos.seed=1234      # replay a run's fault schedule
//	go test ./e2e -run 'TestChaosCluster$' -v -chaos.cluster=10m   # the cluster run, longer
//
// TestChaos starts a throwaway PostgreSQL and a NATS server with JetStream, two `baton relay`
// processes (one streams, the other stands by until the slot is free), three
// examples/echoagent workers (100ms model latency, the read tool; the third also calls the write
// tool; a 3s lease) and examples/subscriber --json. Each process reaches Postgres and NATS
// through TCP proxies of its own (internal/testsvc.Proxy), so network faults hit one process
// at a time, and logs in as its deploy/postgres/roles.sql role (baton_relay, baton_worker; the
// producers baton_app). Beside them a neighbour (neighbour_test.go), logged in as an ordinary
// role with a schema of its own and a connection limit, does at random moments what such a role
// may: million-row transactions, DDL, long-open transactions (one of them open across the
// slot's creation, before the relays start), logical messages of its own
// prefix up to 12 MiB and malformed or foreign baton.answers messages, and it holds every
// advisory key Baton takes or took, all the run. Producers in the test send about 40 messages a second over 139 conversations,
// some with ids that NATS subjects, headers or logs could mistake for something else
// (wildcards, dots, spaces, control characters, non-ASCII, 200 bytes), and retry every
// failed send with the same message id until it is accepted.
//
// Meanwhile faults follow each other at random moments: SIGKILL and restart of a relay (the
// streaming one mostly) or a worker, SIGTERM (which must exit 0) and restart,
// SIGSTOP/SIGCONT, NATS stopped and started on the same store, Postgres fast and immediate
// shutdown and start, termination of the slot's walsender, and on one process's path to
// Postgres or NATS: added latency, reset connections, or a freeze (the path holds every byte
// without closing: a half-open peer). Some outlast the streams' duplicate window, 10s in the
// run (chaosDuplicates): the streaming relay's path to NATS or Postgres frozen, or the relay
// stopped, for 12-20s. And a bandwidth cap on a path from Postgres, and the turns stream's
// MaxMsgs lowered to what it holds plus a few (the relay meets discard-new until the
// workers make room). Beside them, overlapping, a background schedule slows
// one path at a time for 5-20s or resets its connections. The schedules are drawn up front
// from the seed (-chaos.seed; a random one, printed, when zero) and logged as they run, so a
// seed replays the same faults at the same offsets; a failing run prints its seed.
// -chaos.duration (default 1m50s) is how long the load and the faults last; setup, drain and
// checks add about a minute.
//
// Then the faults stop, every fault is healed, and the run drains (2 minutes at most) and
// checks:
//   - every accepted message has exactly one reply or exactly one visible error, and a reply
//     echoes it; visible errors only where a write operation was recorded for the request or
//     its attempts ran out;
//   - no write operation recorded twice for one request, no message echoed by two replies,
//     no reply or error message that answers nothing;
//   - no row pending or processing, no two overlapping runs in a conversation;
//   - the subscriber printed each outcome once (after its dedupe) and each conversation's in
//     commit order;
//   - the slot's confirmed LSN caught up with the WAL, every turn event was acked, the
//     dead-letter stream holds nothing but the neighbour's malformed baton.answers messages;
//   - the outcomes stream holds each outcome once, each conversation's in commit order, none
//     missing; from the workers' debug records of each turn event received (outbox id and
//     stream sequence) and the relays' of each one their replay check did not publish
//     (streams_test.go): every outbox row reached a worker from one stored copy of the turns
//     stream only, each conversation's in commit order, none missing but rows a replay check
//     found finished already;
//   - Postgres refused none of Baton's roles a privilege (SQLSTATE 42501 in its log);
//   - no goroutine or connection leak in the processes (goroutines from /metrics against the
//     idle count before the load; connections counted at each process's proxies), and no
//     process exited unless the test stopped it.
//
// It ends with one line of figures (shown with -v or on failure):
//
//	chaos: cluster=false messages=4700 faults=freeze:3,kill:4,... replies=4650 visible_errors=50 lost=0 doubled=0 finished_unpublished=9 ... seed=1234
//
// TestChaosChecksCatchDefects runs the same system briefly without faults, then plants one
// defect at a time (a lost reply, a second reply, an unjustified visible error, a doubled
// write, overlapping runs, a row left processing, an outcome printed twice or out of order,
// a second stored copy of a turn event, a stale turn event after a newer one, a turn event
// never delivered, a duplicate outcome in the stream, a dead-letter record, a leaked connection, a process that died, a statement that needs a
// privilege the roles lack) and requires the checks to
// report each: a check that cannot fail would let a chaos run pass whatever Baton did.
//
// # The JetStream cluster runs
//
// TestChaosCluster is the chaos run (45s of faults; -chaos.cluster sets the length) on a
// 3-node JetStream cluster with R3 streams, each process reaching every node through a proxy
// of its own (the nodes advertise no others); the NATS fault stops one node, the turns
// stream's leader half the time. make test-long runs it, and TestChaos, for 5 minutes
// (-chaos.long), the neighbour's bulk transactions at 10 million rows.
//
//	go test ./e2e -run JetStreamCluster -v            # about 20 seconds
//
// TestJetStreamCluster runs Baton on a 3-node JetStream cluster in the test process
// (internal/testsvc.StartCluster, sync_interval: always) with streams of 3 replicas: one relay,
// two echoagent workers and the subscriber, each given all three URLs, and the chaos run's
// producers. It stops the turns stream's leader, then a second node (no quorum: it checks the
// relay confirms nothing past a message committed meanwhile), then starts both again, and
// runs the chaos run's checks. It ends with one line:
//
//	cluster: faults=2 (stopped the turns leader baton-n0, then baton-n1: quorum lost; both restarted) messages=600 replies=600 lost=0 doubled=0 in 22s
package e2e
