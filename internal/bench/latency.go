package bench

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"math"
	"net/http"
	"slices"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/nats-io/nats.go/jetstream"
	"golang.org/x/sync/errgroup"

	"github.com/batonhq/baton/internal/opsserver"
	"github.com/batonhq/baton/producer"
	"github.com/batonhq/baton/wire"
)

// runLatency measures commit → stored at each rate, Baton's relay and the plain relay one
// after the other, round after round.
func (r *runner) runLatency(ctx context.Context) error {
	for round := range r.cfg.Rounds {
		for _, rate := range r.cfg.Rates {
			for _, c := range rotate([]string{cRelay, cPlain}, round) {
				r.prog.phase("latency at %s/s, round %d/%d: %s", thousands(float64(rate)), round+1, r.cfg.Rounds, contenderLabel(c))
				if err := r.latencyRun(ctx, round, rate, c); err != nil {
					return fmt.Errorf("latency at %d/s, round %d, %s: %w", rate, round+1, c, err)
				}
			}
			key := fmt.Sprintf("latency_%d.ratio.relay_p99_vs_plain_p99", rate)
			k := fmt.Sprintf("latency_%d.", rate)
			if v := ratio(r.rep.get(round, k+"relay.p99_ms"), r.rep.get(round, k+"plain.p99_ms")); !math.IsNaN(v) {
				r.rep.set(round, key, "baton relay p99 ÷ plain relay p99", "x", v)
			}
		}
	}
	return nil
}

// latencyRun runs contender c (cRelay or cPlain) on a slot of its own while commits come at
// rate for the warm-up and the measured duration, and records commit → stored.
func (r *runner) latencyRun(ctx context.Context, round, rate int, c string) error {
	e := r.e
	if err := clearOutbox(ctx, e.pool); err != nil { // nothing for a first-start backfill
		return err
	}
	slot, prefix := e.names()
	stream := wire.StreamName(prefix, wire.KindTurns)
	var p *process
	var metricsAddr string
	var err error
	if c == cRelay {
		p, err = e.startRelay(ctx, slot, prefix, "BATON_METRICS_ADDR="+opsserver.AnyPort)
	} else {
		if err := createBareSlot(ctx, e.pool, slot); err != nil {
			return err
		}
		p, err = e.startPlain(ctx, slot, prefix)
	}
	if err != nil {
		return err
	}
	defer p.stop(stopGrace)
	if c == cRelay {
		if metricsAddr, err = p.listenAddr(ctx, opsserver.MetricsListening, startTimeout); err != nil {
			return err
		}
	}
	if err := p.waitStreaming(ctx, startTimeout); err != nil {
		return err
	}
	col, err := collectStored(ctx, e, stream)
	if err != nil {
		return err
	}
	defer col.stop()

	// The relay's own histogram is read at the end of the warm-up and after the run.
	var warm, after histogram
	g, gctx := errgroup.WithContext(ctx)
	if metricsAddr != "" {
		g.Go(func() error {
			if sleepCtx(gctx, warmup) != nil {
				return nil // the run failed; its error is the one to report
			}
			h, err := scrapeCommitToAck(gctx, metricsAddr)
			warm = h
			return err
		})
	}
	var recs []commitRecord
	g.Go(func() error {
		var err error
		recs, err = paceCommits(gctx, e, fmt.Sprintf("lat%d-%d-%s", rate, round, c), rate, warmup+r.cfg.LatencyDuration)
		return err
	})
	if err := g.Wait(); err != nil {
		return err
	}
	if err := col.wait(ctx, recs, p); err != nil {
		return err
	}
	if metricsAddr != "" {
		if after, err = scrapeCommitToAck(ctx, metricsAddr); err != nil {
			return err
		}
	}
	p.stop(stopGrace)
	skip := min(rate*int(warmup/time.Second), len(recs)-1)
	lat, missing := latencies(recs[skip:], col.storedTimes())
	if missing > 0 {
		return fmt.Errorf("%d of %d events never reached the stream", missing, len(recs)-skip)
	}
	key := fmt.Sprintf("latency_%d.%s.", rate, c)
	label := contenderLabel(c) + ", commit → stored"
	r.rep.set(round, key+"p50_ms", label+": p50", "ms", ms(percentile(lat, .50)))
	r.rep.set(round, key+"p99_ms", label+": p99", "ms", ms(percentile(lat, .99)))
	r.rep.set(round, key+"max_ms", label+": max", "ms", ms(lat[len(lat)-1]))
	span := recs[len(recs)-1].done.Sub(recs[0].done)
	r.rep.set(round, key+"commits_per_s", contenderLabel(c)+": commits achieved", "commits/s", float64(len(recs)-1)/span.Seconds())
	if metricsAddr != "" {
		if w := after.minus(warm); w.count > 0 {
			r.rep.set(round, key+"self_share_le_1ms", "baton relay's own commit → PubAck histogram: share ≤ 1 ms", "share", w.share(0.001))
		}
	}
	r.rep.samples[fmt.Sprintf("%d/%s", rate, c)] = append(r.rep.samples[fmt.Sprintf("%d/%s", rate, c)], lat...)
	if err := dropSlot(ctx, e.pool, slot); err != nil {
		return err
	}
	return e.deleteStreams(ctx, prefix)
}

// commitRecord is one paced commit: its outbox id and when Send returned.
type commitRecord struct {
	id   int64
	done time.Time
}

// paceCommits sends one user message (message and outbox row, one transaction, through the
// producer) every 1/rate for d, from `producers` connections fed by a pacer on absolute
// deadlines (no drift when one commit is slow), and records when each Send returned.
func paceCommits(ctx context.Context, e *env, tag string, rate int, d time.Duration) ([]commitRecord, error) {
	prod, err := producer.New(producer.Config{})
	if err != nil {
		return nil, err
	}
	n := int(d.Seconds() * float64(rate))
	recs := make([]commitRecord, n)
	jobs := make(chan int, n)
	g, gctx := errgroup.WithContext(ctx)
	for range producers {
		g.Go(func() error {
			conn, err := e.pool.Acquire(gctx)
			if err != nil {
				return fmt.Errorf("producer connection: %w", err)
			}
			defer conn.Release()
			for i := range jobs {
				res, err := prod.Send(gctx, conn, producer.Message{
					ConversationID: conversationID(i, conversations), ID: fmt.Sprintf("%s-%d", tag, i), Content: "hello"})
				if err != nil {
					return fmt.Errorf("send: %w", err)
				}
				recs[i] = commitRecord{id: res.OutboxID, done: time.Now()}
			}
			return nil
		})
	}
	interval := time.Second / time.Duration(rate)
	t0 := time.Now()
	for i := range n {
		if err := sleepCtx(gctx, time.Until(t0.Add(time.Duration(i)*interval))); err != nil {
			break
		}
		jobs <- i
	}
	close(jobs)
	if err := g.Wait(); err != nil {
		return nil, err
	}
	return recs, ctx.Err()
}

// percentile returns the q-quantile of sorted (nearest rank).
func percentile(sorted []time.Duration, q float64) time.Duration {
	if len(sorted) == 0 {
		return 0
	}
	i := int(math.Ceil(q*float64(len(sorted)))) - 1
	return sorted[max(0, min(i, len(sorted)-1))]
}

func ms(d time.Duration) float64 { return float64(d) / float64(time.Millisecond) }

// latencies returns commit returned → at for every record, sorted; records without an
// arrival are counted as missing.
func latencies(recs []commitRecord, at map[int64]time.Time) (sorted []time.Duration, missing int) {
	for _, r := range recs {
		t, ok := at[r.id]
		if !ok {
			missing++
			continue
		}
		sorted = append(sorted, t.Sub(r.done))
	}
	slices.Sort(sorted)
	return sorted, missing
}

// storedCollector records the JetStream store time of each event of a stream stored after it
// started, by outbox id.
type storedCollector struct {
	mu     sync.Mutex
	stored map[int64]time.Time
	cc     jetstream.ConsumeContext
	stream jetstream.Stream
	name   string // the consumer's
}

// collectStored follows stream from now on with a pull consumer of its own that never
// acknowledges. The relay's turns stream is a work queue: an ordered consumer (ack none) is
// refused there, and a consumer must deliver all (no worker runs in the bench, so the stream
// holds only this run's events); one that acknowledged would delete the events. Nothing is
// redelivered before the run ends (ack wait of an hour), and no limit of pending
// acknowledgements stops the delivery.
func collectStored(ctx context.Context, e *env, stream string) (*storedCollector, error) {
	c := &storedCollector{stored: map[int64]time.Time{}}
	st, err := e.js.Stream(ctx, stream)
	if err != nil {
		return nil, fmt.Errorf("follow %s: %w", stream, err)
	}
	deliver := jetstream.DeliverNewPolicy
	if st.CachedInfo().Config.Retention == jetstream.WorkQueuePolicy {
		deliver = jetstream.DeliverAllPolicy
	}
	cons, err := st.CreateConsumer(ctx, jetstream.ConsumerConfig{
		Description:       "baton bench: store times",
		AckPolicy:         jetstream.AckExplicitPolicy,
		AckWait:           time.Hour,
		MaxAckPending:     -1,
		DeliverPolicy:     deliver,
		InactiveThreshold: time.Minute, // the server removes it should stop not run
	})
	if err != nil {
		return nil, fmt.Errorf("follow %s: %w", stream, err)
	}
	c.stream, c.name = st, cons.CachedInfo().Name
	c.cc, err = cons.Consume(func(m jetstream.Msg) {
		md, err := m.Metadata()
		if err != nil {
			return
		}
		id, err := strconv.ParseInt(m.Headers().Get(wire.HeaderOutboxID), 10, 64)
		if err != nil {
			return
		}
		c.mu.Lock()
		c.stored[id] = md.Timestamp
		c.mu.Unlock()
	})
	if err != nil {
		_ = st.DeleteConsumer(ctx, c.name)
		return nil, fmt.Errorf("follow %s: %w", stream, err)
	}
	return c, nil
}

// stop stops the consumer, waits until it has, and deletes it.
func (c *storedCollector) stop() {
	c.cc.Stop()
	<-c.cc.Closed()
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	_ = c.stream.DeleteConsumer(ctx, c.name) // else the server drops it after InactiveThreshold
}

// wait waits until the event of every commit of recs is stored, while p runs, for at most 30 s
// after the last one that arrived. (Waiting for the newest outbox id and a moment more is not
// enough: ids are taken before commit, and a contender seconds behind at a high rate stores
// some older ids well after it.) What never arrives is counted as missing by latencies.
func (c *storedCollector) wait(ctx context.Context, recs []commitRecord, p *process) error {
	next, progress := 0, time.Now()
	for {
		c.mu.Lock()
		for next < len(recs) {
			if _, ok := c.stored[recs[next].id]; !ok {
				break
			}
			next++
			progress = time.Now()
		}
		c.mu.Unlock()
		if next == len(recs) {
			return nil
		}
		if err := p.alive(); err != nil {
			return err
		}
		if time.Since(progress) > 30*time.Second {
			return nil
		}
		if err := sleepCtx(ctx, 10*time.Millisecond); err != nil {
			return err
		}
	}
}

// storedTimes returns a copy of what was collected.
func (c *storedCollector) storedTimes() map[int64]time.Time {
	c.mu.Lock()
	defer c.mu.Unlock()
	out := make(map[int64]time.Time, len(c.stored))
	for k, v := range c.stored {
		out[k] = v
	}
	return out
}

// histogram is a scraped Prometheus histogram: cumulative counts by upper bound.
type histogram struct {
	le    map[float64]float64
	count float64
}

func (h histogram) minus(o histogram) histogram {
	out := histogram{le: map[float64]float64{}, count: h.count - o.count}
	for k, v := range h.le {
		out.le[k] = v - o.le[k]
	}
	return out
}

// share returns the fraction of observations at or below bound (a bucket boundary).
func (h histogram) share(bound float64) float64 {
	if h.count == 0 {
		return 0
	}
	return h.le[bound] / h.count
}

// commitToAck is the relay's histogram of commit record timestamp → PubAck.
const commitToAck = "baton_relay_commit_to_ack_seconds"

// scrapeCommitToAck reads the relay's commit → PubAck histogram from its /metrics.
func scrapeCommitToAck(ctx context.Context, addr string) (histogram, error) {
	ctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, "http://"+addr+"/metrics", nil)
	if err != nil {
		return histogram{}, err
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		return histogram{}, fmt.Errorf("scrape the relay's metrics: %w", err)
	}
	defer func() { _ = resp.Body.Close() }()
	if resp.StatusCode != http.StatusOK {
		return histogram{}, fmt.Errorf("scrape the relay's metrics: %s", resp.Status)
	}
	h, err := parseHistogram(bufio.NewScanner(resp.Body), commitToAck)
	if err != nil {
		return histogram{}, fmt.Errorf("scrape the relay's metrics: %w", err)
	}
	return h, nil
}

// parseHistogram reads histogram name from a Prometheus text exposition.
func parseHistogram(sc *bufio.Scanner, name string) (histogram, error) {
	h := histogram{le: map[float64]float64{}}
	sc.Buffer(make([]byte, 64<<10), 1<<20)
	found := false
	for sc.Scan() {
		line := sc.Text()
		switch {
		case strings.HasPrefix(line, name+`_bucket{le="`):
			bound, value, ok := strings.Cut(strings.TrimPrefix(line, name+`_bucket{le="`), `"} `)
			if !ok {
				continue
			}
			le, err1 := strconv.ParseFloat(bound, 64)
			v, err2 := strconv.ParseFloat(value, 64)
			if err1 == nil && err2 == nil {
				h.le[le] = v
			}
		case strings.HasPrefix(line, name+"_count "):
			h.count, _ = strconv.ParseFloat(strings.TrimPrefix(line, name+"_count "), 64)
			found = true
		}
	}
	if err := sc.Err(); err != nil {
		return h, err
	}
	if !found {
		return h, errors.New("no " + name)
	}
	return h, nil
}
