package sparse

import "github.com/vksparse/vksparse/vk"

// This file lends the conformance tests (package sparse_test, through
// package sparsetest) the ranges of a step's state that only the package
// knows.

// IdleRanges returns the ranges of step s (a *Step, *TacticStep,
// *LuKAStep or *DensePlan), uint32 words, that hold 0 between steps: the
// arrival counters and the atomic extremes of its kernels.
func IdleRanges(s any) []vk.Range {
	switch s := s.(type) {
	case *DensePlan:
		return []vk.Range{s.arrivals.All()}
	case *TacticStep:
		return append(IdleRanges(s.Step), s.tactic.extremes.All(), s.tactic.fitArrived.All())
	case *LuKAStep:
		return []vk.Range{s.arrivedScore.All(), s.arrivedOut.All()}
	case *Step:
		r := IdleRanges(s.plan)
		switch sel := s.sel.(type) {
		case *QuestSelector:
			r = append(r, sel.arrived.All(), sel.extremes.All())
		case *OracleSelector:
			r = append(r, sel.arrived.All(), sel.extremes.All())
		case *DoublePSelector:
			r = append(r, sel.extremes.All())
		case *H2OSelector:
			l := sel.layout()
			r = append(r, vk.Range{Buffer: sel.scratch.Buffer, Offset: sel.scratch.Offset + l.arrivedScore, Size: l.obs - l.arrivedScore})
		}
		return r
	}
	return nil
}

// ScratchRanges returns the ranges of step s that a step writes before it
// reads them (scores, bins, cuts, logits, partials).
func ScratchRanges(s any) []vk.Range {
	all := func(bufs ...*vk.Buffer) []vk.Range {
		var r []vk.Range
		for _, b := range bufs {
			if b != nil { // a buffer the step's variant does not use
				r = append(r, b.All())
			}
		}
		return r
	}
	switch s := s.(type) {
	case *TacticStep:
		return all(s.tactic.sampled, s.tactic.fixedE, s.tactic.planBuf, s.tactic.cut, s.tactic.scores, s.tactic.binOf, s.tactic.binSums)
	case *LuKAStep:
		return all(s.row, s.mz, s.outPart)
	case *Step:
		switch sel := s.sel.(type) {
		case *QuestSelector:
			return all(sel.score, sel.binOf, sel.cut)
		case *OracleSelector:
			return all(sel.score, sel.binOf, sel.cut)
		case *DoublePSelector:
			return all(sel.logits, sel.binOf, sel.exact, sel.keep)
		case *H2OSelector:
			l := sel.layout()
			return []vk.Range{{Buffer: sel.scratch.Buffer, Offset: sel.scratch.Offset + l.part, Size: l.arrivedScore - l.part}}
		}
	}
	return nil
}
