package sparse

import (
	"errors"
	"fmt"

	"github.com/vksparse/vksparse/vk"
)

// Workspace is device memory for attention's partial results (each chunk's
// unnormalised output, maximum and sum) that plans which never run at the
// same time share: a model's layers attend one after another, so one
// workspace of B regions serves every layer's batch of B sequences, where
// each plan would otherwise hold its own. A plan moves into it with Share.
// The workspace grows to the largest plan's need, binding the plans
// already in it anew. Commands that use two plans sharing regions must
// order them with a compute barrier. Selectors' scratch (state that lives
// within one step, such as H2O's logits) lies in its own regions of the
// workspace, one a sequence, shared the same way. A Workspace belongs to
// one goroutine at a time, with the plans and selectors in it.
type Workspace struct {
	dev           *vk.Device
	partO, partML *vk.Buffer
	perO, perML   uint64 // bytes of a region
	regions       int
	plans         map[*DensePlan]int // plan → its first region

	scratch        *vk.Buffer // zero between steps where its users need it so
	perScratch     uint64     // bytes of a scratch region
	scratchRegions int
	users          map[scratchUser]int // user → its region
}

// scratchUser is a selector whose per-step scratch may lie in a workspace
// region: scratchBytes is its size, and bindScratch binds the selector's
// kernels to r (a range of at least scratchBytes bytes whose counters
// read zero) of w, releasing what was bound before.
type scratchUser interface {
	scratchBytes() uint64
	bindScratch(r vk.Range, w *Workspace) error
}

// regionAlign is the alignment of a region's offset, above any device's
// minStorageBufferOffsetAlignment.
const regionAlign = 256

// NewWorkspace returns an empty workspace on dev; it takes memory as plans
// move in.
func NewWorkspace(dev *vk.Device) *Workspace {
	return &Workspace{dev: dev, plans: map[*DensePlan]int{}, users: map[scratchUser]int{}}
}

// Bytes returns the device memory the workspace holds.
func (w *Workspace) Bytes() uint64 { return vk.Held(w.partO, w.partML, w.scratch) }

// shareScratch binds u's scratch to the workspace's scratch region
// region, growing the scratch (zeroed, its users bound anew) when it does
// not fit. On error u keeps what it had bound.
func (w *Workspace) shareScratch(u scratchUser, region int) error {
	switch {
	case w == nil || w.plans == nil:
		return fmt.Errorf("sparse: share scratch into a released workspace: %w", vk.ErrReleased)
	case region < 0:
		return fmt.Errorf("sparse: workspace region %d is negative", region)
	}
	size := roundUp(u.scratchBytes(), regionAlign)
	if region >= w.scratchRegions || size > w.perScratch {
		regions, per := max(region+1, w.scratchRegions), max(size, w.perScratch)
		buf, err := w.dev.NewBuffer(uint64(regions)*per, vk.DeviceLocal)
		if err != nil {
			return err
		}
		if err := w.dev.Run(func(c *vk.Commands) { c.Fill(buf.All(), 0) }); err != nil {
			return errors.Join(err, buf.Release())
		}
		old := w.scratch
		w.scratch, w.perScratch, w.scratchRegions = buf, per, regions
		var errs []error
		for v, r := range w.users {
			errs = append(errs, v.bindScratch(w.scratch.Slice(uint64(r)*per, per), w))
		}
		if err := errors.Join(append(errs, releaseAll(old))...); err != nil {
			return err
		}
	}
	if err := u.bindScratch(w.scratch.Slice(uint64(region)*w.perScratch, w.perScratch), w); err != nil {
		return err
	}
	w.users[u] = region
	return nil
}

// leaveScratch forgets u: its region no longer follows the workspace.
func (w *Workspace) leaveScratch(u scratchUser) {
	if w != nil && w.users != nil {
		delete(w.users, u)
	}
}

// Share moves the plan's partials into the workspace's regions first,
// first+1, …, one a sequence, and releases the plan's own; the workspace
// grows if they do not fit. On error the plan keeps what it had, unless
// its bindings could not be made again (then it reports it and must be
// released).
func (p *DensePlan) Share(w *Workspace, first int) error {
	switch {
	case w == nil || w.plans == nil:
		return fmt.Errorf("sparse: Share into a released workspace: %w", vk.ErrReleased)
	case p.ws == w && w.plans[p] == first:
		return nil
	case p.ws != nil:
		return fmt.Errorf("sparse: the plan already shares a workspace")
	case first < 0:
		return fmt.Errorf("sparse: workspace region %d is negative", first)
	case w.dev != p.d.dev:
		return fmt.Errorf("sparse: a workspace of another device")
	}
	o, ml := p.partBytes()
	o, ml = roundUp(o, regionAlign), roundUp(ml, regionAlign)
	if err := w.reserve(first+len(p.seqs), o, ml); err != nil {
		return err
	}
	old := p.parts
	moved, err := p.rebind(func() { p.parts = w.ranges(first, len(p.seqs), o, ml) }, func() { p.parts = old })
	if !moved {
		return err
	}
	err = errors.Join(err, releaseAll(p.partO, p.partML))
	p.partO, p.partML = nil, nil
	p.ws = w
	w.plans[p] = first
	return err
}

// ranges returns the partials of sequences regions from first on, for a
// plan whose sequences take o and ml bytes each (packed, as its kernels
// index them).
func (w *Workspace) ranges(first, sequences int, o, ml uint64) [2]vk.Range {
	return [2]vk.Range{
		w.partO.Slice(uint64(first)*w.perO, uint64(sequences)*o),
		w.partML.Slice(uint64(first)*w.perML, uint64(sequences)*ml),
	}
}

// reserve grows the workspace to regions regions of at least o and ml
// bytes, binding the plans in it to the new memory.
func (w *Workspace) reserve(regions int, o, ml uint64) error {
	if regions <= w.regions && o <= w.perO && ml <= w.perML {
		return nil
	}
	regions, o, ml = max(regions, w.regions), max(o, w.perO), max(ml, w.perML)
	partO, err := w.dev.NewBuffer(uint64(regions)*o, vk.DeviceLocal)
	if err != nil {
		return err
	}
	partML, err := w.dev.NewBuffer(uint64(regions)*ml, vk.DeviceLocal)
	if err != nil {
		return errors.Join(err, partO.Release())
	}
	oldO, oldML := w.partO, w.partML
	w.partO, w.partML, w.perO, w.perML, w.regions = partO, partML, o, ml, regions
	var errs []error
	for p, first := range w.plans {
		po, pml := p.partBytes()
		_, err := p.rebind(func() { p.parts = w.ranges(first, len(p.seqs), roundUp(po, regionAlign), roundUp(pml, regionAlign)) }, nil)
		errs = append(errs, err)
	}
	return errors.Join(append(errs, releaseAll(oldO, oldML))...)
}

// Release frees the workspace's memory; it refuses while a plan shares it.
func (w *Workspace) Release() error {
	if w.plans == nil {
		return vk.ErrReleased
	}
	if len(w.plans) > 0 || len(w.users) > 0 {
		return fmt.Errorf("sparse: %d plans and %d selectors still share the workspace: release them first", len(w.plans), len(w.users))
	}
	err := releaseAll(w.partO, w.partML, w.scratch)
	w.partO, w.partML, w.scratch, w.plans, w.users = nil, nil, nil, nil, nil
	return err
}

// Share moves each step's partials, and its selector's scratch where it
// has some, into the workspace, sequence i into region i.
func (b *Batch) Share(w *Workspace) error {
	for i, s := range b.steps {
		if err := s.plan.Share(w, i); err != nil {
			return err
		}
		if u, ok := s.sel.(scratchUser); ok {
			if err := w.shareScratch(u, i); err != nil {
				return err
			}
		}
	}
	return nil
}

// Share moves each step's partials into the workspace, sequence i into
// region i.
func (b *TacticBatch) Share(w *Workspace) error { return b.batch.Share(w) }

func roundUp(x, a uint64) uint64 { return (x + a - 1) / a * a }
