package bench

import (
	"context"
	"fmt"
	"io"
	"math"
	"net/http"
	"os"
	"path/filepath"
	"time"

	"github.com/jackc/pglogrepl"

	"github.com/batonhq/baton/internal/opsserver"
	"github.com/batonhq/baton/wire"
)

// ProfileFile is the name of the relay's CPU profile in Config.ProfileDir.
const ProfileFile = "relay-catchup.pprof"

// profileRelay runs one more catch-up of b's backlog by `baton relay` with its profiling
// listener on (BATON_PPROF_ADDR), takes a CPU profile of it from its "streaming" line for
// longer than the rounds' median catch-up (the idle end adds no samples) and writes it to
// cfg.ProfileDir. Its figures are not recorded: profiling costs the relay a little.
func (r *runner) profileRelay(ctx context.Context, b backlog, s slotFor, end pglogrepl.LSN) error {
	e := r.e
	if err := os.MkdirAll(r.cfg.ProfileDir, 0o750); err != nil {
		return fmt.Errorf("profile directory: %w", err)
	}
	secs := 5.0
	if m := float64(r.rep.Figures[b.key+"."+cRelay+".start_to_stored_s"].Median); !math.IsNaN(m) {
		secs = math.Ceil(1.25*m) + 1
	}
	p, err := e.startRelay(ctx, s.slot, s.prefix, "BATON_PPROF_ADDR="+opsserver.AnyPort)
	if err != nil {
		return err
	}
	defer p.stop(stopGrace)
	addr, err := p.listenAddr(ctx, opsserver.PprofListening, startTimeout)
	if err != nil {
		return err
	}
	if err := p.waitStreaming(ctx, startTimeout); err != nil {
		return err
	}
	type fetched struct {
		data []byte
		err  error
	}
	got := make(chan fetched, 1)
	pctx, cancel := context.WithTimeout(ctx, time.Duration(secs)*time.Second+time.Minute)
	defer cancel()
	go func() {
		data, err := fetchProfile(pctx, addr, int(secs))
		got <- fetched{data, err}
	}()
	_, err = r.follow(ctx, p, s.slot, wire.StreamName(s.prefix, wire.KindTurns), r.cfg.Rows, end)
	prof := <-got // before stopping the relay, which ends the profile
	if err != nil {
		return err
	}
	if prof.err != nil {
		return prof.err
	}
	path := filepath.Join(r.cfg.ProfileDir, ProfileFile)
	if err := os.WriteFile(path, prof.data, 0o600); err != nil {
		return fmt.Errorf("write the profile: %w", err)
	}
	r.rep.Profile = path
	p.stop(stopGrace)
	if err := dropSlot(ctx, e.pool, s.slot); err != nil {
		return err
	}
	return e.deleteStreams(ctx, s.prefix)
}

// fetchProfile takes a CPU profile of secs seconds from the pprof listener at addr, which the
// relay logged once it listened there.
func fetchProfile(ctx context.Context, addr string, secs int) ([]byte, error) {
	url := fmt.Sprintf("http://%s/debug/pprof/profile?seconds=%d", addr, secs)
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, url, nil)
	if err != nil {
		return nil, err
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		return nil, fmt.Errorf("fetch the relay's CPU profile: %w", err)
	}
	defer func() { _ = resp.Body.Close() }()
	data, err := io.ReadAll(resp.Body)
	if err != nil {
		return nil, fmt.Errorf("fetch the relay's CPU profile: %w", err)
	}
	if resp.StatusCode != http.StatusOK {
		return nil, fmt.Errorf("fetch the relay's CPU profile: %s: %s", resp.Status, data)
	}
	return data, nil
}
