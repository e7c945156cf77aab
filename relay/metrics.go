package relay

import (
	"errors"
	"log/slog"
	"sync/atomic"
	"time"

	"github.com/prometheus/client_golang/prometheus"
)

// metrics are the relay's Prometheus collectors, all prefixed baton_relay_.
type metrics struct {
	events                             *prometheus.CounterVec // kind: turn|outcome|ignored|backfill
	turns, outcomes, backfill, ignored prometheus.Counter     // events' children, resolved once
	omitted                            prometheus.Counter
	replaySkipped                      prometheus.Counter
	traceDropped                       prometheus.Counter
	deadLetter                         *prometheus.CounterVec // kind: answers|turn|outcome
	publishLatency                     prometheus.Histogram
	commitToAck                        prometheus.Histogram
	confirmedLSN                       prometheus.Gauge
	slotLagBytes                       prometheus.Gauge
	walsenderBusy                      prometheus.Gauge
	inFlight                           prometheus.Gauge
	inFlightBytes                      prometheus.Gauge
	active                             prometheus.Gauge
	batched                            prometheus.Gauge
	batching                           prometheus.Gauge
	switches                           *prometheus.CounterVec
	reconnects                         prometheus.Counter
	errors                             *prometheus.CounterVec // stage: postgres|nats|publish|decode
	slotLost                           prometheus.Gauge
	slotCreateWaiting                  prometheus.Gauge
	fatal                              *prometheus.GaugeVec // reason: setup|slot_lost
	streamFull                         *prometheus.GaugeVec // stream
	// full says, per lane (its stream), that a publish was refused for lack of room and none
	// succeeded since; fullSince is when that began (UnixNano). Kept across sessions.
	full      [laneCount]atomic.Bool
	fullSince [laneCount]atomic.Int64
	fullMsgID [laneCount]atomic.Pointer[string] // the Nats-Msg-Id of the event last refused
}

func newMetrics(reg prometheus.Registerer) *metrics {
	latency := []float64{.0001, .00025, .0005, .001, .0025, .005, .01, .025, .05, .1, .25, .5, 1, 2.5, 5, 10}
	m := &metrics{
		events: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "baton_relay_events_total", Help: "Events acknowledged by JetStream, by kind (turn, outcome, backfill) and changes ignored.",
		}, []string{"kind"}),
		omitted: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "baton_relay_content_omitted_total", Help: "Outcome events published without content because it exceeded the max payload.",
		}),
		replaySkipped: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "baton_relay_replay_skipped_total",
			Help: "Events of a session's replay that an earlier session had stored already (or turn events whose outbox row was finished meanwhile): not published again.",
		}),
		traceDropped: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "baton_relay_trace_context_dropped_total",
			Help: "Rows whose trace_context was not a valid W3C traceparent: their events were published without one.",
		}),
		deadLetter: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "baton_relay_deadletter_total",
			Help: "Changes no retry could publish, set aside in the dead-letter stream (acknowledged there), by kind.",
		}, []string{"kind"}),
		publishLatency: prometheus.NewHistogram(prometheus.HistogramOpts{
			Name: "baton_relay_publish_seconds", Help: "Time from publish to PubAck.", Buckets: latency,
		}),
		commitToAck: prometheus.NewHistogram(prometheus.HistogramOpts{
			Name: "baton_relay_commit_to_ack_seconds", Help: "Time from the Postgres commit to the PubAck of its event.", Buckets: latency,
		}),
		confirmedLSN: prometheus.NewGauge(prometheus.GaugeOpts{
			Name: "baton_relay_confirmed_lsn", Help: "The LSN last confirmed to Postgres (as a number).",
		}),
		slotLagBytes: prometheus.NewGauge(prometheus.GaugeOpts{
			Name: "baton_relay_slot_lag_bytes", Help: "Bytes between the server's WAL end and the confirmed LSN, as of the last keepalive.",
		}),
		walsenderBusy: prometheus.NewGauge(prometheus.GaugeOpts{
			Name: "baton_relay_walsender_busy",
			Help: "1 while the relay waits on its walsender, seen busy decoding (a large transaction) and answering no status update.",
		}),
		inFlight: prometheus.NewGauge(prometheus.GaugeOpts{
			Name: "baton_relay_in_flight", Help: "Events published or queued and not yet acknowledged.",
		}),
		inFlightBytes: prometheus.NewGauge(prometheus.GaugeOpts{
			Name: "baton_relay_in_flight_bytes", Help: "Bytes of the events published or queued and not yet acknowledged (bounded by --max-in-flight-bytes).",
		}),
		active: prometheus.NewGauge(prometheus.GaugeOpts{
			Name: "baton_relay_active", Help: "1 while this relay holds the slot and streams, 0 as standby or reconnecting.",
		}),
		batching: prometheus.NewGauge(prometheus.GaugeOpts{
			Name: "baton_relay_publishing_batches", Help: "1 while the relay publishes in batches (it is behind: catching up, or a busy conversation), 0 while it publishes event by event (it keeps up, or batches are off: see baton_relay_publish_batched).",
		}),
		switches: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "baton_relay_publish_switches_total", Help: "Switches of the way the relay publishes, by what it publishes in afterwards: batches (it fell behind) or events (it keeps up again).",
		}, []string{"to"}),
		batched: prometheus.NewGauge(prometheus.GaugeOpts{
			Name: "baton_relay_publish_batched", Help: "1 while the streams take JetStream fast-ingest batches, which the relay uses while it is behind (see baton_relay_publishing_batches), 0 when it publishes event by event only (--classic-publish, or a server or stream without them).",
		}),
		reconnects: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "baton_relay_reconnects_total", Help: "Sessions restarted after an error.",
		}),
		errors: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "baton_relay_errors_total", Help: "Errors that ended a session, by stage.",
		}, []string{"stage"}),
		slotCreateWaiting: prometheus.NewGauge(prometheus.GaugeOpts{
			Name: "baton_relay_slot_create_waiting",
			Help: "1 while creating the slot waits for transactions that were running when it began to end (a neighbour's long transaction); the relay's WARN log names them.",
		}),
		slotLost: prometheus.NewGauge(prometheus.GaugeOpts{
			Name: "baton_relay_slot_lost", Help: "1 when the slot was invalidated (wal_status lost): recreate it, see the README.",
		}),
		fatal: prometheus.NewGaugeVec(prometheus.GaugeOpts{
			Name: "baton_relay_fatal",
			Help: "1 once the relay stopped on an error no retry can fix, by reason (setup, slot_lost); its ERROR log says what to do.",
		}, []string{"reason"}),
		streamFull: prometheus.NewGaugeVec(prometheus.GaugeOpts{
			Name: "baton_relay_stream_full",
			Help: "1 while the stream refuses events for lack of room (max_msgs or max_bytes with discard new: the turns stream): the relay holds its LSN and retries until the workers' acknowledgements free room.",
		}, []string{"stream"}),
	}
	for _, reason := range []string{fatalSetup, fatalSlotLost} {
		m.fatal.WithLabelValues(reason).Set(0)
	}
	m.turns = m.events.WithLabelValues("turn")
	m.outcomes = m.events.WithLabelValues("outcome")
	m.backfill = m.events.WithLabelValues("backfill")
	m.ignored = m.events.WithLabelValues("ignored")
	for _, to := range []string{"batches", "events"} {
		m.switches.WithLabelValues(to) // shown from the start, at 0
	}
	if reg != nil {
		reg.MustRegister(m.events, m.omitted, m.replaySkipped, m.traceDropped, m.deadLetter, m.publishLatency, m.commitToAck, m.confirmedLSN,
			m.slotLagBytes, m.walsenderBusy, m.inFlight, m.inFlightBytes, m.active, m.batched, m.batching, m.switches, m.reconnects, m.errors, m.slotLost, m.slotCreateWaiting, m.fatal, m.streamFull)
	}
	return m
}

// Reasons of baton_relay_fatal.
const (
	fatalSetup    = "setup"
	fatalSlotLost = "slot_lost"
)

// stopped records in baton_relay_fatal the error no retry can fix with which Run returns.
func (m *metrics) stopped(err error) {
	reason := fatalSetup
	if errors.Is(err, ErrSlotLost) {
		reason = fatalSlotLost
	}
	m.fatal.WithLabelValues(reason).Set(1)
}

// streamIsFull records that stream (of lane) refused the event msgID for lack of room, and
// reports whether that starts an episode: the first refusal since the stream last stored an
// event.
func (m *metrics) streamIsFull(lane int, stream, msgID string) bool {
	m.fullMsgID[lane].Store(&msgID)
	if m.full[lane].Swap(true) {
		return false
	}
	m.fullSince[lane].Store(time.Now().UnixNano())
	m.streamFull.WithLabelValues(stream).Set(1)
	return true
}

// roomAgain ends stream's full episode: a publish to it succeeded. Called on a PubAck while
// full[lane] is set; logs at INFO once per episode.
func (m *metrics) roomAgain(log *slog.Logger, lane int, stream string) {
	if !m.full[lane].Swap(false) {
		return
	}
	m.streamFull.WithLabelValues(stream).Set(0)
	full := time.Since(time.Unix(0, m.fullSince[lane].Load())).Round(time.Millisecond)
	log.Info("stream has room again; publishing resumed", "stream", stream, "full_for", full.String())
}

// refused reports whether msgID is the event the stream of lane refused last.
func (m *metrics) refused(lane int, msgID string) bool {
	id := m.fullMsgID[lane].Load()
	return id != nil && *id == msgID && msgID != ""
}
