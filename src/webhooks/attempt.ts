/**
 * One delivery attempt, made: the signed request of SPEC ("Webhooks"), sent through the SSRF
 * guard, and its answer judged. No database here: this is what the sending thread
 * (sender.ts) runs, off the service's event loop.
 */
import { createHmac } from 'node:crypto';
import type { Clock } from '../clock/clock.ts';
import { OutboundError, requestGuarded, resolveGuarded, type GuardedTarget } from '../net/outbound.ts';

/** SPEC: a 2xx within 5 seconds; anything else is a failed attempt. */
export const DELIVERY_TIMEOUT_MS = 5_000;
export const USER_AGENT = 'AgentVault-Webhooks/1.0';
/** A receiver's answer is read up to this size; a larger one fails the attempt. */
const RESPONSE_BYTES_MAX = 256 * 1024;
/** What the delivery log keeps of a receiver's answer. */
const RESPONSE_EXCERPT_CHARS = 500;

/** `Service-Signature`: lowercase hex HMAC-SHA256 of the raw body, keyed with the secret's UTF-8 bytes. */
export function signatureOf(body: string, secret: string): string {
  return createHmac('sha256', secret).update(body, 'utf8').digest('hex');
}

export interface Signing {
  secret: string;
  /** the secret before the last rotation, while its overlap lasts */
  previousSecret: string | null;
}

export function deliveryHeaders(body: string, signing: Signing, ids: { eventId: string; deliveryId: string; attempt: number }): Record<string, string> {
  return {
    'content-type': 'application/json',
    'user-agent': USER_AGENT,
    'service-signature': signatureOf(body, signing.secret),
    ...(signing.previousSecret === null ? {} : { 'service-signature-previous': signatureOf(body, signing.previousSecret) }),
    'service-event-id': ids.eventId,
    'service-delivery-id': ids.deliveryId,
    'service-delivery-attempt': String(ids.attempt),
  };
}

/** What an attempt needs to be made. */
export interface AttemptRequest {
  deliveryId: string;
  eventId: string;
  attempt: number;
  url: string;
  signing: Signing;
  /** null when the event is no longer stored (the delivery cannot be made) */
  body: string | null;
}

export interface AttemptResult {
  succeeded: boolean;
  statusCode: number | null;
  latencyMs: number;
  error: string | null;
  responseExcerpt: string | null;
}

/** An attempt made, with the service clock's time when it began and when its answer came. */
export interface SentAttempt {
  attemptedAt: Date;
  finishedAt: Date;
  result: AttemptResult;
}

/**
 * Text a receiver sent, made storable: its first RESPONSE_EXCERPT_CHARS characters (code points,
 * so that a character outside the BMP is never cut in half), without NUL (which PostgreSQL text
 * refuses). Four bytes of UTF-8 hold any character, so the bytes read always hold enough.
 */
function excerptOf(body: Buffer): string | null {
  if (!body.length) return null;
  return Array.from(body.subarray(0, RESPONSE_EXCERPT_CHARS * 4).toString('utf8').replace(/\u0000/g, ''))
    .slice(0, RESPONSE_EXCERPT_CHARS).join('');
}

/**
 * Makes one attempt, to the target `target` resolves its URL to (`resolveGuarded`: the URL
 * checked, its name resolved and every address vetted), within DELIVERY_TIMEOUT_MS of its start,
 * the wait for that resolution included (DESIGN §8: the 5 s are the attempt's, DNS and all);
 * never throws: every way it can go wrong, a target that could not be resolved included, is a
 * failed attempt with a reason.
 */
export async function sendAttempt(request: AttemptRequest, target: (url: string) => Promise<GuardedTarget>): Promise<AttemptResult> {
  if (request.body === null) {
    return { succeeded: false, statusCode: null, latencyMs: 0, error: 'The event is no longer stored (past its retention).', responseExcerpt: null };
  }
  const startedMs = performance.now();
  try {
    const response = await requestGuarded(target(request.url), {
      method: 'POST',
      headers: deliveryHeaders(request.body, request.signing, { eventId: request.eventId, deliveryId: request.deliveryId, attempt: request.attempt }),
      body: request.body,
      timeoutMs: DELIVERY_TIMEOUT_MS,
      maxBytes: RESPONSE_BYTES_MAX,
    });
    const succeeded = response.status >= 200 && response.status < 300;
    let error: string | null = null;
    if (response.status >= 300 && response.status < 400) {
      error = `The endpoint answered ${response.status}, a redirect, which is not followed: a 2xx is required.`;
    } else if (!succeeded) {
      error = `The endpoint answered ${response.status}: a 2xx is required.`;
    }
    return { succeeded, statusCode: response.status, latencyMs: response.latencyMs, error, responseExcerpt: excerptOf(response.body) };
  } catch (error) {
    const message = error instanceof OutboundError ? `${error.message}.` : 'The request could not be made.';
    // An answer whose body was too large came: its status is kept (the attempt failed all the same).
    const statusCode = error instanceof OutboundError ? error.statusCode : null;
    return { succeeded: false, statusCode, latencyMs: Math.round(performance.now() - startedMs), error: message, responseExcerpt: null };
  }
}

export interface SendOptions {
  allowPrivate: boolean;
  /** attempts in flight at once */
  concurrency: number;
  /**
   * no attempt is started this long (ms) after the batch began: the attempts started so far are
   * answered, and the caller decides about the rest (absent: every attempt is made)
   */
  startWithinMs?: number;
}

/**
 * Makes every attempt, at most `concurrency` at a time; the outcomes in the requests' order. A
 * URL is checked, resolved and vetted once per batch (a batch's attempts are made within
 * seconds of one another; a stream batch's all go to one webhook), not once per attempt: by the
 * first attempt to it, with that attempt's deadline, so the resolution ends within the deadline
 * of every attempt waiting for it (each counts the wait against its own 5 s). With
 * `startWithinMs`, attempts not started by then are not made: the outcomes answered are those
 * of the requests' first ones (attempts start in order).
 */
export async function sendAttempts(requests: readonly AttemptRequest[], options: SendOptions, clock: Clock): Promise<SentAttempt[]> {
  const targets = new Map<string, Promise<GuardedTarget>>();
  const targetOf = (url: string): Promise<GuardedTarget> => {
    let target = targets.get(url);
    if (!target) {
      target = resolveGuarded(url, { timeoutMs: DELIVERY_TIMEOUT_MS, allowPrivate: options.allowPrivate });
      target.catch(() => {}); // each attempt awaiting it reports the failure
      targets.set(url, target);
    }
    return target;
  };
  const sent: SentAttempt[] = new Array(requests.length);
  let next = 0;
  const startBy = options.startWithinMs === undefined ? Infinity : performance.now() + options.startWithinMs;
  const sender = async (): Promise<void> => {
    while (next < requests.length && performance.now() < startBy) {
      const index = next++;
      const request = requests[index]!;
      const attemptedAt = new Date(clock.nowMs());
      const result = await sendAttempt(request, targetOf);
      sent[index] = { attemptedAt, finishedAt: new Date(clock.nowMs()), result };
    }
  };
  await Promise.all(Array.from({ length: Math.min(Math.max(1, options.concurrency), requests.length) }, sender));
  return sent.slice(0, next);
}
