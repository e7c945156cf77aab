package relay

import (
	"sync"
	"testing"
)

// watched holds, for each slot a test watches (WatchPipelines), the newest pipeline made with
// that slot in its Config, or a nil *pipeline before the first.
var watched sync.Map

func init() {
	pipelineMade = func(cfg *Config, p *pipeline) {
		if _, ok := watched.Load(cfg.Slot); ok {
			watched.Store(cfg.Slot, p)
		}
	}
}

// WatchPipelines makes PipelineState report on the pipelines of the relays of slot, until the
// test ends.
func WatchPipelines(t testing.TB, slot string) {
	watched.Store(slot, (*pipeline)(nil))
	t.Cleanup(func() { watched.Delete(slot) })
}

// PipelineState returns, for the newest pipeline of slot (see WatchPipelines), how many
// transaction entries it holds (transactions not yet confirmed, and keepalive positions behind
// them) and how many events are outstanding; ok is false before the first pipeline.
func PipelineState(slot string) (txs, outstanding int, ok bool) {
	v, _ := watched.Load(slot)
	p, _ := v.(*pipeline)
	if p == nil {
		return 0, 0, false
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	return len(p.txs), p.outstanding(), true
}
