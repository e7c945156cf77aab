package consumer

import "github.com/prometheus/client_golang/prometheus"

type metrics struct {
	turns          *prometheus.CounterVec // outcome: done|retry|error|lease_lost|cancelled|commit_failed
	turnSeconds    prometheus.Histogram
	claimConflicts prometheus.Counter
	oldestPending  prometheus.Gauge
	recoveries     *prometheus.CounterVec // result: pending|failed
	attempts       prometheus.Histogram
	operations     *prometheus.CounterVec // effect
	events         *prometheus.CounterVec // result: acked|nacked|terminated|misaddressed
	running        prometheus.Gauge
	batchSize      *prometheus.HistogramVec // statement: claim|finish|tool|history
	lostClaims     *prometheus.CounterVec   // result: handed_back|failed
}

func newMetrics(reg prometheus.Registerer) *metrics {
	m := &metrics{
		turns: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "baton_worker_turns_total", Help: "Turns by outcome: done, retry, error (visible failure), lease_lost, cancelled (conversation deleted), commit_failed.",
		}, []string{"outcome"}),
		turnSeconds: prometheus.NewHistogram(prometheus.HistogramOpts{
			Name: "baton_worker_turn_seconds", Help: "Claim to final commit.",
			Buckets: []float64{.001, .005, .01, .05, .1, .5, 1, 5, 10, 30, 60, 300},
		}),
		claimConflicts: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "baton_worker_claim_conflicts_total", Help: "Claims that found the conversation held by another run.",
		}),
		oldestPending: prometheus.NewGauge(prometheus.GaugeOpts{
			Name: "baton_worker_oldest_pending_seconds", Help: "Age of the oldest pending outbox row, as of the last sweep.",
		}),
		recoveries: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "baton_worker_recoveries_total", Help: "Runs with expired leases recovered: back to pending, or failed visibly.",
		}, []string{"result"}),
		attempts: prometheus.NewHistogram(prometheus.HistogramOpts{
			Name: "baton_worker_claim_attempts", Help: "The attempt number of each claimed turn.", Buckets: []float64{1, 2, 3, 5, 10},
		}),
		operations: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "baton_worker_operations_total", Help: "Tool calls recorded, by effect.",
		}, []string{"effect"}),
		events: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "baton_worker_events_total", Help: "JetStream turn events settled: acked, nacked (redelivered later), terminated (malformed), misaddressed (terminated: the subject names another conversation than the body).",
		}, []string{"result"}),
		running: prometheus.NewGauge(prometheus.GaugeOpts{
			Name: "baton_worker_running_turns", Help: "Turns running now.",
		}),
		batchSize: prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Name: "baton_worker_batch_size", Help: "Conversations per claim or final-commit statement, tool calls per record statement, turns per history read (more under load).",
			Buckets: []float64{1, 2, 4, 8, 16, 32, 64},
		}, []string{"statement"}),
		lostClaims: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "baton_worker_lost_claims_total", Help: "Runs of claims that failed after they may have committed (the answer was lost): handed_back (they had committed: rows pending again, attempt refunded), failed (not handed back: rows they took wait for their lease to end).",
		}, []string{"result"}),
	}
	if reg != nil {
		reg.MustRegister(m.turns, m.turnSeconds, m.claimConflicts, m.oldestPending, m.recoveries, m.attempts,
			m.operations, m.events, m.running, m.batchSize, m.lostClaims)
	}
	return m
}
